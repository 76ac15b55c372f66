"""Proposers: one file each, one protocol (``specjax.draft.base``), one registry.

    base.py         Draft, the Proposer / TreeProposer / Rider protocols, shared draft steps
    registry.py     method name -> builder
    draft_model.py  a separate small model (chain or tree), with its DraftModel type
    ngram.py        prompt lookup in the row's own text
    heads.py        Medusa and EAGLE networks, their config, saving and loading
    medusa.py       Medusa heads' proposer
    eagle.py        the EAGLE head's proposer
    dflash.py       the block drafter: its network and proposer (config in heads.py)
    mtp.py          multi-token prediction modules' proposer (network in heads.py)
    rider.py        what Medusa and EAGLE share (the target's features between rounds)
    suffix.py       suffix decoding: the row's text and earlier requests' outputs
    lookahead.py    lookahead decoding: the target's own Jacobi window
    vocab.py        draft vocabularies (a cut LM head)
"""

from __future__ import annotations

from . import dflash, draft_model, lookahead, mtp, ngram, rider, suffix
from . import heads as heads_lib
from .base import Draft, Proposer, Rider, TreeProposer, draw, expand_tree, tree_candidates
from .dflash import DFlashProposer
from .draft_model import (
    DraftModel,
    DraftModelProposer,
    DraftTreeProposer,
    SpelledChainProposer,
    for_tokenizers,
    load_draft_model,
    map_vocab,
    restrict_vocab,
    shared_prefix,
    vocab_coverage,
)
from .eagle import EagleProposer
from .heads import Heads, HeadsConfig, init_heads, load_heads, save_heads
from .lookahead import LookaheadProposer
from .medusa import MedusaProposer
from .mtp import MTPProposer
from .ngram import NgramProposer
from .registry import Method, get, names, register, unregister
from .rider import Features
from .suffix import SuffixCache, SuffixProposer
from .vocab import DraftVocab, frequent_tokens, token_pairs, token_spellings

# The built-in methods, one line each.
register("draft_model", draft_model.build, draft="model", tree=True,
         params=draft_model.program_params, adaptive=True)
register("ngram", ngram.build)
register("medusa", rider.build, draft="heads", tree=True, params=heads_lib.program_params,
         adaptive=True)
register("eagle", rider.build, draft="heads", tree=True, params=heads_lib.program_params,
         adaptive=True)
register("dflash", dflash.build, draft="heads", tree=True, params=heads_lib.program_params,
         adaptive=True)
register("mtp", mtp.build, draft="heads", params=heads_lib.program_params, adaptive=True)
register("suffix", suffix.build, draft="corpus", tree=True, params=suffix.corpus,
         after_call=suffix.after_call)
register("lookahead", lookahead.build, tree=True)


def load_draft(path, dtype: str | None = None, *, full_vocab: bool = False) -> DraftModel:
    """Deprecated: ``sj.load_draft_model``."""
    import warnings
    warnings.warn("sj.draft.load_draft is renamed sj.load_draft_model", DeprecationWarning,
                  stacklevel=2)
    return load_draft_model(path, dtype, full_vocab=full_vocab)


__all__ = ["Draft", "Proposer", "TreeProposer", "Rider", "draw", "expand_tree", "tree_candidates",
           "DraftModel", "DraftModelProposer", "DraftTreeProposer", "load_draft_model",
           "restrict_vocab", "shared_prefix", "map_vocab", "token_pairs", "token_spellings",
           "for_tokenizers", "SpelledChainProposer",
           "vocab_coverage", "NgramProposer",
           "MedusaProposer", "EagleProposer", "DFlashProposer", "MTPProposer", "SuffixCache",
           "SuffixProposer", "LookaheadProposer", "Features",
           "Heads", "HeadsConfig", "init_heads", "load_heads", "save_heads",
           "DraftVocab", "frequent_tokens", "Method", "register", "unregister", "get", "names"]
