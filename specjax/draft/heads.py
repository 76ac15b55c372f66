"""Drafters that ride on the target: Medusa heads, an EAGLE feature head, a block drafter
(``dflash``, specjax/draft/dflash.py; its network lives there, its config, saving and loading
here) and multi-token prediction modules (``mtp``, specjax/draft/mtp.py: EAGLE's layer, one per
draft depth, with input norms).

None has its own embedding or vocabulary projection: each reads the target's hidden states
(Medusa, EAGLE and MTP its final-norm one, its "feature", the vector the LM head turns into
logits; the block drafter some layers' too) and decodes through the target's frozen LM head
(EAGLE's and MTP's layers end in an RMSNorm of their own before it).

* **Medusa** (``method="medusa"``): K heads on the feature h_t of the last position the target
  saw. Head k is a residual block, ``h + silu(h W_k + b_k)``, projected through the LM head; it
  guesses the token k positions after the one the target itself predicts from h_t (head 1 guesses
  d_1 while the verifier's own distribution gives the token before it). The heads are independent
  of one another, so all K come out of one batched matmul per round.
* **EAGLE** (``method="eagle"``): one decoder layer that autoregresses in feature space. Its input
  at position t is ``fc([f_t ; embed(x_{t+1})])``: the target's feature at t and the embedding
  (the target's) of the token that followed; its output, after an RMSNorm, is the feature it
  predicts for t + 1, which the LM head turns into the next draft. It keeps its own one-layer KV
  cache, rolled back like the others.

Draft vocabulary: both may draft from a subset of the vocabulary, the M most frequent tokens of the
training corpus (as FR-Spec and EAGLE-3 do), so a draft step projects onto M columns of the LM head
instead of V. On a memory-bound CPU that projection is most of a drafter's cost. Drafts outside the
subset are never proposed; verification is unchanged, so the output distribution is still exactly
the target's.

Parameters::

    weights   trainable: medusa {"w": [K, E, E], "b": [K, E]};
              eagle {"fc": [2E, E'], "layer": one DecoderLayer of width E' (E unless
              narrowed), "proj": [E', E] (only when E' != E), "norm": [E]};
              mtp {"0": .., "K-1": ..}, each eagle's plus "hnorm" [E] and "enorm" [E];
              dflash: see specjax/draft/dflash.py
    vocab     a DraftVocab: ids [M] int32 (into the target's vocabulary) and the target's
              LM head columns for them [E, M] (derived, never saved)

Saved with orbax next to a ``drafter.json`` that records the method, sizes and the target it was
trained for (its config and a fingerprint of its weights); ``load_heads(path, target)`` refuses a
different target.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from ..attention import BLOCK, current_block
from ..cache import KVCache
from ..config import ModelConfig
from ..model import DecoderLayer, Model, RMSNorm, rope_tables
from ..model import view as model_view
from .vocab import DraftVocab, check_vocab

HEADS_METHODS = ("medusa", "eagle", "dflash", "mtp")
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
    method: str  # one of HEADS_METHODS
    hidden_size: int  # E, the target's
    vocab_size: int  # V, the target's
    draft_vocab_size: int  # M <= V: tokens the drafter can propose
    num_heads: int = 0  # medusa: K heads; mtp: K modules (the deepest draft either can make)
    layer: ModelConfig | None = None  # eagle, mtp: the one-layer config (the target's layer
    #   shape); dflash: its layers' config (num_hidden_layers of them)
    block_size: int = 0  # dflash: the most drafts one block makes (what it was trained for)
    taps: tuple[int, ...] = ()  # dflash: the target layers whose outputs it reads

    def __post_init__(self):
        if self.method not in HEADS_METHODS:
            raise ValueError(f"heads method {self.method!r} is unknown; known: "
                             f"{', '.join(HEADS_METHODS)}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in [1, "
                             f"{self.vocab_size}] (the target's vocab_size)")
        if self.method in ("medusa", "mtp") and self.num_heads < 1:
            raise ValueError(f"a {self.method} drafter needs num_heads >= 1, got "
                             f"{self.num_heads}")
        if self.method in ("eagle", "dflash", "mtp") and self.layer is None:
            raise ValueError(f"an {self.method} drafter needs its layer config")
        from ..tree import MAX_DEPTH
        if self.method == "dflash" and (
                isinstance(self.block_size, bool) or not isinstance(self.block_size, int)
                or not 1 <= self.block_size <= MAX_DEPTH or not self.taps):
            raise ValueError(f"a dflash drafter needs an int block_size in [1, {MAX_DEPTH}] and "
                             f"at least one target layer to read, got "
                             f"block_size={self.block_size!r}, taps={self.taps!r}")

    @property
    def max_depth(self) -> int | None:
        """The deepest draft (chain length or tree depth) this drafter can make per round:
        Medusa's head count, MTP's module count, the block drafter's block size; None (no
        limit) for EAGLE."""
        return {"medusa": self.num_heads, "mtp": self.num_heads,
                "dflash": self.block_size}.get(self.method)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Heads:
    """A Medusa, EAGLE, block (dflash) or MTP drafter: its config (static) and parameters
    {"weights", "vocab"} (plus "calibration" when adaptive lengths' map was shipped)."""

    config: HeadsConfig = dataclasses.field(metadata=dict(static=True))
    params: Any

    @property
    def vocab(self) -> DraftVocab:
        return self.params["vocab"]


def eagle_layer_config(target: ModelConfig, width: int | None = None) -> ModelConfig:
    """EAGLE's layer: the target's layer shape, one layer, no sliding window. ``width``: a
    narrower (or wider) layer of that many channels, with the target's head size, as many query
    heads as fit (at least one) and the largest kv-head count that divides them and the
    target's."""
    layer = target.single_layer()
    if width is None or width == target.hidden_size:
        return layer
    heads = max(1, width // target.head_dim)
    return dataclasses.replace(layer, hidden_size=width, num_attention_heads=heads,
                               num_key_value_heads=math.gcd(heads, target.num_key_value_heads),
                               head_dim=target.head_dim)


def embed(target_params, tokens: Array) -> Array:
    """The target's embedding of tokens [...] -> [..., E]."""
    return jnp.take(target_params["embed_tokens"]["embedding"], tokens, axis=0)


# ---------------------------------------------------------------------------------------------
# The networks


def medusa_heads(weights, h: Array) -> Array:
    """h [..., E] -> the K heads' features [..., K, E]: h + silu(h W_k + b_k)."""
    z = jnp.einsum("...e,kef->...kf", h, weights["w"].astype(h.dtype)) + weights["b"].astype(
        h.dtype)
    return h[..., None, :] + nn.silu(z)


class EagleNet(nn.Module):
    """fc([feature ; embedding]) -> one decoder layer -> RMSNorm: the predicted next feature.
    With ``input_norms`` (an MTP module) the feature and the embedding each pass an RMSNorm of
    their own ("hnorm", "enorm") before the fc. A layer narrower than the target's features
    (``feature_size``) reads them through the fc and writes its prediction back into their space
    through a projection ("proj") before the norm."""

    config: ModelConfig  # the one-layer config
    init_std: float = 0.02
    block: int = BLOCK  # slots per attention block
    input_norms: bool = False
    feature_size: int | None = None  # E, the target's; None: the layer's own width

    @nn.compact
    def __call__(self, feats, embeds, view, k, v):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        feats, embeds = feats.astype(dtype), embeds.astype(dtype)
        if self.input_norms:
            feats = RMSNorm(cfg.rms_norm_eps, dtype, name="hnorm")(feats)
            embeds = RMSNorm(cfg.rms_norm_eps, dtype, name="enorm")(embeds)
        x = jnp.concatenate([feats, embeds], axis=-1)
        x = nn.Dense(cfg.hidden_size, use_bias=False, dtype=dtype, param_dtype=dtype, name="fc",
                     kernel_init=nn.initializers.normal(self.init_std))(x)
        cos, sin = rope_tables(view.positions, cfg)
        (x, k, v), _ = DecoderLayer(cfg, self.init_std, self.block, name="layer")(
            (x, k, v), jnp.zeros((), jnp.int32), cos, sin, view)
        if self.feature_size not in (None, cfg.hidden_size):
            x = nn.Dense(self.feature_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                         name="proj", kernel_init=nn.initializers.normal(self.init_std))(x)
        return RMSNorm(cfg.rms_norm_eps, dtype, name="norm")(x), k, v


def eagle_forward(config: HeadsConfig, weights, feats: Array, embeds: Array, positions: Array,
                  cache: KVCache, chunk_mask: Array | None = None) -> tuple[Array, KVCache]:
    """Feed T (feature, next-token embedding) pairs [B, T, E] at positions [B, T]; the pairs are
    written at slots cache.length .. + T - 1 (chunk_mask as in ``model.forward``). Returns the
    predicted features [B, T, E] and the cache with length + T. For an MTP drafter, ``weights``
    are one module's."""
    T = feats.shape[1]
    block = current_block()
    out, k, v = EagleNet(config.layer, block=block, input_norms=config.method == "mtp",
                         feature_size=config.hidden_size).apply(
        {"params": weights}, feats, embeds, model_view(cache, positions, chunk_mask, None, block),
        cache.k, cache.v)
    return out, KVCache(k, v, cache.length + T)


# ---------------------------------------------------------------------------------------------
# Building, saving, loading


def _with_head(config: HeadsConfig, weights, vocab: np.ndarray, target: Model) -> Heads:
    return Heads(config, {"weights": weights, "vocab": DraftVocab.of(target, vocab)})


def program_params(heads: Heads) -> dict:
    """What a compiled program takes for Medusa / EAGLE ``heads``: their params with a checked
    calibration for adaptive lengths (``params["calibration"]``; the identity when they ship
    none, so heads with and without one share the program)."""
    from ..adaptive import checked_calibration
    return {**heads.params, "calibration": checked_calibration(
        heads.params.get("calibration"), "the heads' calibration")}


def default_taps(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """``count`` target layers spread evenly up to the last: (1, 3, 5) of 6."""
    n = min(count, num_layers)
    return tuple(round((i + 1) * num_layers / n) - 1 for i in range(n))


def init_heads(target: Model, method: str, key: Array, *, num_heads: int = 4,
               vocab: np.ndarray | None = None, dtype: str = "float32",
               intermediate_size: int | None = None, init_std: float = 0.02,
               num_layers: int = 2, block_size: int = 16,
               taps: tuple[int, ...] | None = None, layer_width: int | None = None) -> Heads:
    """A fresh drafter for ``target``. vocab: the draft vocabulary ids (default: all V).
    intermediate_size: EAGLE's or the block drafter's MLP width (default: the target's); a
    narrower one makes each draft step cheaper. layer_width: EAGLE's or MTP's layer width
    (default: the target's E; see ``eagle_layer_config``), read from and projected back to the
    target's features. dflash: ``num_layers`` layers drafting up to
    ``block_size`` tokens a block from the outputs of target layers ``taps`` (default: three
    spread to the last, ``default_taps``). mtp: ``num_heads`` modules (the deepest draft).

    Medusa heads start as the identity (W = 0, b = 0), so before training every head predicts
    what the LM head does; EAGLE's, MTP's and the block drafter's layers start from
    N(0, init_std²) weights."""
    cfg = target.config
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int | np.integer):
        raise ValueError(f"num_heads must be an int, got {num_heads!r}")  # its range: below
    num_heads = int(num_heads)
    vocab = np.arange(cfg.vocab_size, dtype=np.int32) if vocab is None else check_vocab(
        vocab, cfg.vocab_size)
    if intermediate_size is not None and (method == "medusa" or int(intermediate_size) < 1):
        raise ValueError(f"intermediate_size={intermediate_size!r}: only an EAGLE, MTP or "
                         f"dflash drafter has an MLP width, and it must be >= 1")
    if layer_width is not None and (method not in ("eagle", "mtp") or isinstance(
            layer_width, bool) or not isinstance(layer_width, int | np.integer)
            or layer_width < 2):
        raise ValueError(f"layer_width={layer_width!r}: only an EAGLE or MTP drafter has a "
                         f"layer width of its own, and it must be an int >= 2")
    E = cfg.hidden_size
    layer = None
    if method in ("eagle", "dflash", "mtp"):
        layer = eagle_layer_config(dataclasses.replace(target.config, dtype=dtype),
                                   None if layer_width is None else int(layer_width))
        if intermediate_size is not None:
            layer = dataclasses.replace(layer, intermediate_size=int(intermediate_size))
    if method == "dflash":
        from ..model import check_taps
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        taps = default_taps(cfg.num_hidden_layers) if taps is None else check_taps(cfg, taps)
        layer = dataclasses.replace(layer, num_hidden_layers=num_layers)
    config = HeadsConfig(method, E, cfg.vocab_size, int(vocab.size),
                         num_heads if method in ("medusa", "mtp") else 0, layer,
                         block_size if method == "dflash" else 0,
                         tuple(taps) if method == "dflash" else ())
    if method == "medusa":
        weights = {"w": jnp.zeros((num_heads, E, E), dtype), "b": jnp.zeros((num_heads, E), dtype)}
    elif method == "dflash":
        from .dflash import init_weights
        weights = init_weights(config, key, init_std)
    else:
        mtp = method == "mtp"
        if mtp:  # one EAGLE-shaped layer with input norms per module
            weights = {str(i): _init_layer(layer, float(init_std), True, E, k)
                       for i, k in enumerate(jax.random.split(key, num_heads))}
        else:
            weights = _init_layer(layer, float(init_std), False, E, key)
    return _with_head(config, weights, vocab, target)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _init_layer(layer: ModelConfig, init_std: float, input_norms: bool, features: int,
                key: Array):
    """Fresh weights of an EAGLE-shaped layer (an MTP module with ``input_norms``) reading
    ``features``-wide target features: one program per shape, traced and compiled once per
    process however many drafters of that shape are made."""
    dtype = jnp.dtype(layer.dtype)
    cache = KVCache.init(layer, 1, 1)
    positions = jnp.zeros((1, 1), jnp.int32)
    return EagleNet(layer, init_std, input_norms=input_norms, feature_size=features).init(
        key, jnp.zeros((1, 1, features), dtype), jnp.zeros((1, 1, features), dtype),
        model_view(cache, positions, None, None), cache.k, cache.v)["params"]


def fingerprint(target: Model | Heads) -> dict[str, list[float]]:
    """A few values of every target weight, rounded to bfloat16: the same for the target in any
    dtype it is stored or loaded in, different for any other trained or initialised model.
    Of Heads: of their own weights (what a heads folder's calibration records)."""
    # A layer weight is fingerprinted as the [L, ...] stack of its L layers' copies (the layout
    # drafters were first saved against), picked one value at a time, so nothing is stacked.
    if isinstance(target, Heads):
        params, L = target.params["weights"], 0
    else:
        params, L = target.params, target.config.num_hidden_layers
    groups: dict[str, list] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [str(getattr(k, "key", k)) for k in path]
        if L and keys[0] == "layers":  # layers/<i>/... -> layers/...
            groups.setdefault("/".join(["layers"] + keys[2:]), [None] * L)[int(keys[1])] = leaf
        else:
            groups["/".join(keys)] = [leaf]
    out = {}
    for name, leaves in groups.items():
        size = leaves[0].size
        index = np.linspace(0, size * len(leaves) - 1, 8).astype(np.int64)
        # pick on the device: only 8 values per weight come to the host
        picks = [leaves[i // size].reshape(-1)[i % size] for i in index]
        picks = np.asarray(jax.device_get(
            jnp.stack(picks).astype(jnp.bfloat16).astype(jnp.float32)))
        out[name] = [float(x) for x in picks]
    return out


def target_record(target: Model) -> dict:
    """What a drafter records of its target: sizes and the weights' fingerprint."""
    c = target.config
    return {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_hidden_layers, "fingerprint": fingerprint(target)}


def _check_record(record: dict, meta: pathlib.Path) -> None:
    """drafter.json's fields, each of its type, or a ValueError naming the file and the field
    (a hand-edited or damaged file raised KeyError or TypeError from deep in the loader)."""
    def is_int(v, low):
        return isinstance(v, int) and not isinstance(v, bool) and v >= low
    target = record["target"]
    problems = []
    if not isinstance(target, dict):
        problems.append(f"target is {target!r}, not an object")
    else:
        problems += [f"target.{k} is {target.get(k)!r}, not an int >= 1"
                     for k in ("vocab_size", "hidden_size", "num_hidden_layers")
                     if not is_int(target.get(k), 1)]
        if not isinstance(target.get("fingerprint"), dict):
            problems.append("target.fingerprint is missing or not an object")
    if record["method"] not in HEADS_METHODS:
        problems.append(f"method is {record['method']!r}, not one of {HEADS_METHODS}")
    if not is_int(record["num_heads"], 0):
        problems.append(f"num_heads is {record['num_heads']!r}, not an int >= 0")
    if record["dtype"] not in ("float32", "bfloat16", "float16"):
        problems.append(f"dtype is {record['dtype']!r}, not float32, bfloat16 or float16")
    for k, low in (("num_layers", 1), ("block_size", 1), ("intermediate_size", 1),
                   ("layer_width", 1)):
        if record.get(k) is not None and not is_int(record[k], low):
            problems.append(f"{k} is {record[k]!r}, not an int >= {low}")
    taps = record.get("taps")
    if taps is not None and not (isinstance(taps, list) and all(is_int(t, 0) for t in taps)):
        problems.append(f"taps is {taps!r}, not a list of layer numbers")
    if problems:
        raise ValueError(f"{meta}: {'; '.join(problems)}; save the drafter again with "
                         f"sj.save_heads or `specjax train heads`")


def check_sizes(record: dict, target: Model, source: str) -> None:
    """Refuse a target of other sizes than the one a drafter was trained for."""
    c = target.config
    for name in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if record[name] != getattr(c, name):
            raise ValueError(f"{source} was trained for a target with {name}={record[name]}; "
                             f"this target has {name}={getattr(c, name)}")


def differing_weight(recorded: dict, model: Model | Heads) -> str | None:
    """The first weight of a recorded ``fingerprint`` that ``model`` lacks or whose values differ
    from ``model``'s (beyond bfloat16 rounding), or None when they all match."""
    mine = fingerprint(model)
    for name, values in recorded.items():
        if name not in mine or not np.allclose(mine[name], values, rtol=1e-2, atol=1e-6):
            return name
    return None


def check_target(record: dict, target: Model, source: str) -> None:
    """Refuse a target other than the one a drafter was trained for (ValueError naming why)."""
    check_sizes(record, target, source)
    name = differing_weight(record["fingerprint"], target)
    if name is not None:
        raise ValueError(f"{source} was trained for another target: its weight {name!r} "
                         f"differs from this target's (load the target it was trained on, or "
                         f"train the drafter for this one with `specjax train heads`)")


HEADS_FILES = ("drafter.json", "vocab.npy", "weights", "calibration.json")
"""What a drafter folder's save owns (an earlier save's are replaced; other files stay)."""


def save_heads(drafter: Heads, path: str | os.PathLike, target: Model, *,
               dtype: str | None = None, extra: dict | None = None,
               files: dict[str, str] | None = None) -> None:
    """Write drafter.json and the trainable weights (orbax) to ``path``; the LM head is the
    target's and is not saved. dtype: cast the weights (e.g. "bfloat16") before saving. files:
    more text files to write in the same save ({name: text}, e.g. a model card). The save
    replaces an earlier one in one atomic swap (``specjax/files.py``); a calibration.json of the
    earlier drafter is dropped with it, other files in the folder are kept."""
    import orbax.checkpoint as ocp

    from ..files import replace_folder
    c = drafter.config
    weights = drafter.params["weights"]
    if dtype is not None:
        weights = jax.tree.map(lambda x: x.astype(dtype), weights)
    record = {"format_version": FORMAT_VERSION, "method": c.method,
              "num_heads": c.num_heads, "draft_vocab_size": c.draft_vocab_size,
              "intermediate_size": None if c.layer is None else c.layer.intermediate_size,
              **({"layer_width": c.layer.hidden_size} if c.method in ("eagle", "mtp") else {}),
              **({"num_layers": c.layer.num_hidden_layers, "block_size": c.block_size,
                  "taps": list(c.taps)} if c.method == "dflash" else {}),
              "dtype": str(jax.tree.leaves(weights)[0].dtype), "target": target_record(target),
              **(extra or {})}
    names = set(HEADS_FILES) | set(files or {})
    with replace_folder(path, lambda name: name in names) as tmp:
        (tmp / "drafter.json").write_text(json.dumps(record, indent=1) + "\n")
        np.save(tmp / "vocab.npy", np.asarray(drafter.vocab.ids))
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(tmp.resolve() / "weights", weights, force=True)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)


def load_heads(path: str | os.PathLike, target: Model, *, same_target: bool = True) -> Heads:
    """Load a drafter saved by ``save_heads`` for ``target``. Raises ValueError if
    they were trained for another target. Weights take the target's dtype.

    same_target=False skips the weights' fingerprint (the sizes must still match): for training
    the drafter on, from these weights, for a target that was itself trained further
    (``specjax train heads --init``); such a drafter must not be used for decoding as is."""
    import orbax.checkpoint as ocp

    from ..files import read_json_object, recover_folder
    if not isinstance(target, Model):
        raise ValueError(f"target must be an sj.Model (sj.load_model), got "
                         f"{type(target).__name__}")
    path = pathlib.Path(path).resolve()
    recover_folder(path)
    meta = path / "drafter.json"
    if not meta.is_file():
        raise FileNotFoundError(f"{path} is not a drafter directory (no drafter.json); train one "
                                f"with `specjax train heads`")
    record = read_json_object(meta, "; save the drafter again with sj.save_heads or `specjax "
                                    "train heads`")
    missing = [k for k in ("target", "method", "num_heads", "dtype") if k not in record]
    if missing and record.get("format_version") == FORMAT_VERSION:
        raise ValueError(f"{meta} lacks {missing}; save the drafter again")
    if record.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta}: format_version {record.get('format_version')!r} is not "
                         f"{FORMAT_VERSION}")
    _check_record(record, meta)
    if same_target:
        check_target(record["target"], target, str(path))
    else:
        check_sizes(record["target"], target, str(path))
    try:
        vocab = np.load(path / "vocab.npy")  # never a pickle
        check_vocab(vocab, target.config.vocab_size)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path / 'vocab.npy'}: {e}") from None
    dtype = target.config.dtype
    # the weights' shapes only: traced, never computed (initialising them took ~1 s a load)
    shape = jax.eval_shape(lambda key: init_heads(
        target, record["method"], key, num_heads=max(record["num_heads"], 1), vocab=vocab,
        dtype=dtype, intermediate_size=record.get("intermediate_size"),
        num_layers=record.get("num_layers", 2), block_size=record.get("block_size", 16),
        taps=tuple(record["taps"]) if "taps" in record else None,
        layer_width=record.get("layer_width")), jax.random.key(0))
    abstract = shape.params["weights"]
    with ocp.StandardCheckpointer() as ckpt:
        weights = ckpt.restore(path / "weights", jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, record["dtype"]), abstract))
    weights = jax.tree.map(lambda x: jnp.asarray(x, dtype), weights)
    heads = _with_head(shape.config, weights, vocab, target)
    from ..adaptive import load_calibration
    # adaptive lengths' calibration.json, if shipped (and fitted for these weights)
    calibration = load_calibration(path, heads)
    if calibration is not None:
        heads = Heads(heads.config, {**heads.params, "calibration": calibration})
    return heads
