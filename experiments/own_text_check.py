"""How well drafters agree with the target on the text the target writes, on prompts no choice
was made on (2026-12-05-own-text.md).

    python experiments/own_text_check.py agreement --data ~/specjax-work/gen OLD_DRAFT NEW_DRAFT
    python experiments/own_text_check.py accepted --data ~/specjax-work/gen --method eagle \
        --gamma 4 OLD_HEADS NEW_HEADS
    python experiments/own_text_check.py long --data ~/specjax-work/gen OLD_DRAFT NEW_DRAFT

``agreement``: the target continues 32 random windows of the held-out stream (64 tokens; 16
greedy, 16 at T = 1, 192 new tokens each); teacher-forced over the continuations, how often each
draft model's argmax over its draft vocabulary is the target's argmax, and Σ min(p, q) (a
draft's acceptance at T = 1). ``accepted``: ``sj.generate`` on 32 function-definition prompts
from held-out files no bench prompt set uses (``pair.calibration_prompts``), 96 new tokens,
greedy and T = 0.8: tokens a round and acceptance of each drafter folder. ``long``: the same on
24 windows of 300-900 tokens of the held-out stream (no end-of-text token inside; not the long
bench set's cuts), 64 new tokens, also by the position a round starts at. ``--data``: the folder
`specjax train pair data` wrote (corpus.json, heldout.npy).
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import specjax as sj
from specjax.train import pair
from specjax.train.loop import _logits

ROOT = pathlib.Path(__file__).resolve().parents[1]
CKPT = ROOT / "checkpoints"


def target_text(target, heldout: np.ndarray) -> jnp.ndarray:
    """[32, 256] rows: 64 held-out tokens and the target's 192 (16 greedy, then 16 at T = 1)."""
    starts = np.random.default_rng(99).integers(0, len(heldout) - 64, 32)
    prompts = [heldout[s:s + 64].astype(int).tolist() for s in starts]
    rows = []
    for temperature, group in [(0.0, prompts[:16]), (1.0, prompts[16:])]:
        out = sj.generate(target, group, key=5, sampling=sj.SamplingParams(
            temperature=temperature, max_new_tokens=192))
        rows.append(np.concatenate([np.asarray(group), np.asarray(out.tokens)[:, :192]], 1))
    return jnp.asarray(np.concatenate(rows), jnp.int32)


def agreement(target, folders: list[str], heldout: np.ndarray) -> None:
    rows = target_text(target, heldout)
    t_logits = _logits(target.config, target.params, rows[:, :-1])[:, 63:]  # the target's part
    t_argmax = np.asarray(jnp.argmax(t_logits, -1))
    p = jax.nn.softmax(t_logits, -1)
    for folder in folders:
        draft = sj.load_draft_model(folder, dtype="float32")
        vocab = np.asarray(draft.vocab.ids)
        d_logits = _logits(draft.model.config, draft.model.params, rows[:, :-1])[:, 63:, vocab]
        agree = vocab[np.asarray(jnp.argmax(d_logits, -1))] == t_argmax
        q = jnp.zeros_like(p).at[..., vocab].set(jax.nn.softmax(d_logits, -1))
        overlap = np.asarray(jnp.minimum(p, q).sum(-1))
        print(f"{folder}: argmax agreement {agree[:16].mean():.4f} (greedy rows), "
              f"{agree[16:].mean():.4f} (T = 1 rows); sum min(p, q) {overlap[:16].mean():.4f} "
              f"/ {overlap[16:].mean():.4f}")


def long_prompts(heldout: np.ndarray, n: int = 24) -> list[list[int]]:
    """``n`` windows of 300-900 held-out tokens (a pure function of the stream) with no
    end-of-text token (id 0) inside, so each stays within one file."""
    rng = np.random.default_rng(123)
    prompts = []
    while len(prompts) < n:
        length = int(rng.integers(300, 901))
        start = int(rng.integers(0, len(heldout) - length))
        window = heldout[start:start + length]
        if not (window == 0).any():
            prompts.append(window.astype(int).tolist())
    return prompts


def accepted(target, folders: list[str], method: str, gamma: int, prompts: list[list[int]],
             max_new_tokens: int) -> None:
    """Each drafter folder's tokens a round on ``prompts``, greedy and at T = 0.8 (with the
    acceptance rate, and by the context position a round starts at)."""
    for folder in folders:
        drafter = (sj.load_draft_model(folder) if method == "draft_model"
                   else sj.load_heads(folder, target))
        for temperature in (0.0, 0.8):
            stats = sj.generate(target, prompts, draft=drafter, key=0, spec=sj.SpecConfig(
                method=method, num_speculative_tokens=gamma), sampling=sj.SamplingParams(
                temperature=temperature, max_new_tokens=max_new_tokens)).stats
            bins = ", ".join(f"{lo}-{hi}: {m:.3f}" for lo, hi, m, _ in
                             stats.accepted_length_by_position)
            print(f"{folder} T={temperature}: tokens a round {stats.mean_accepted_length:.3f}, "
                  f"acceptance {stats.acceptance_rate:.3f} ({bins})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", choices=["agreement", "accepted", "long"])
    ap.add_argument("folders", nargs="+", help="drafter folders (agreement: draft models)")
    ap.add_argument("--data", type=pathlib.Path, default=pathlib.Path("~/specjax-work"))
    ap.add_argument("--method", default="draft_model", help="accepted: the drafters' method")
    ap.add_argument("--gamma", type=int, default=4)
    args = ap.parse_args()
    data = args.data.expanduser()
    target = sj.load_model(CKPT / "code-target", dtype="float32")
    if args.check == "agreement":
        agreement(target, args.folders, np.load(data / "heldout.npy"))
    elif args.check == "long":
        accepted(target, args.folders, args.method, args.gamma,
                 long_prompts(np.load(data / "heldout.npy")), 64)
    else:
        prompts = pair.calibration_prompts(data, sj.load_tokenizer(CKPT / "code-target"), 32)
        accepted(target, args.folders, args.method, args.gamma, prompts, 96)


if __name__ == "__main__":
    main()
