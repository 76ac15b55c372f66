"""Issue 24: does the bundled draft fall off at long positions for want of capacity?

The draft's held-out loss, attending to every position, is flat with position (3.667 / 3.681 /
3.626 at 0-256 / 256-512 / 512-1024) while the target's falls, and more of the target's text
did not change that (2026-12-05-long-positions.md). This grows the shipped draft without
changing what it computes -- a third layer whose output projections start at zero, and a
key/value head per query head (the one it has, copied) -- then distils it on the same long
rows of the target's text as ``draft-gen-long`` did (the control), and compares held-out loss
by position.

    python experiments/grow_draft.py start --data W      # grow, check it is the same function
    python experiments/grow_draft.py train --data W --minutes 40     # resumable
    python experiments/grow_draft.py eval --data W run FOLDER...     # loss by position
    python experiments/grow_draft.py export --data W OUT             # a draft folder

W: the workdir with train.npy / heldout.npy in the bundled tokenizer (and draft-gen-long-text,
the control's generated rows, copied so that both train on the same rows).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys

import numpy as np

GROWN_LAYERS, GROWN_KV_HEADS = 3, 2


def grown_config():
    from specjax.train.pair import DRAFT
    return dataclasses.replace(DRAFT, num_hidden_layers=GROWN_LAYERS,
                               num_key_value_heads=GROWN_KV_HEADS)


def grow(draft, seed: int = 11):
    """The shipped draft with GROWN_LAYERS layers and GROWN_KV_HEADS key/value heads, computing
    the same function: each key/value head copied to the query heads that shared it, new layers
    drawn at random with their output projections (o_proj, down_proj) zero."""
    import jax
    import jax.numpy as jnp

    from specjax.model import Model, init_model
    config = grown_config()
    old = draft.config
    repeat = config.num_key_value_heads // old.num_key_value_heads
    fresh = init_model(config, jax.random.key(seed)).params
    params = jax.tree_util.tree_map(lambda x: x, fresh)
    for name in ("embed_tokens", "lm_head", "norm"):
        params[name] = draft.params[name]
    D = old.head_dim
    for i in range(old.num_hidden_layers):
        layer = jax.tree_util.tree_map(lambda x: x, draft.params["layers"][str(i)])
        for proj in ("k_proj", "v_proj"):
            kernel = layer["self_attn"][proj]["kernel"]  # [H, kv * D]
            heads = kernel.reshape(kernel.shape[0], old.num_key_value_heads, 1, D)
            layer["self_attn"][proj]["kernel"] = jnp.broadcast_to(
                heads, (kernel.shape[0], old.num_key_value_heads, repeat, D)
            ).reshape(kernel.shape[0], -1)
        params["layers"][str(i)] = layer
    for i in range(old.num_hidden_layers, config.num_hidden_layers):
        layer = params["layers"][str(i)]
        for part, proj in (("self_attn", "o_proj"), ("mlp", "down_proj")):
            layer[part][proj]["kernel"] = jnp.zeros_like(layer[part][proj]["kernel"])
    return Model(config, params)


def start(workdir: pathlib.Path) -> None:
    import jax.numpy as jnp

    import specjax as sj
    from specjax.bundle import bundled
    from specjax.train.pair import DRAFT, _start
    # as trained, attending to every position (the shipped folder sets a window at export)
    draft = _start(bundled("code-draft"), DRAFT, "draft")
    grown = grow(draft)
    tokens = jnp.asarray(np.load(workdir / "heldout.npy")[:2 * 512].reshape(2, 512), jnp.int32)
    from specjax.model import logits
    a, b = logits(draft, tokens), logits(grown, tokens)
    gap = float(jnp.max(jnp.abs(a - b)))
    print(f"grown draft: {grown.config.num_hidden_layers} layers, "
          f"{grown.config.num_key_value_heads} kv heads; max |logit difference| {gap:.2e}")
    if gap > 1e-3:
        raise SystemExit("the grown draft computes another function")
    sj.save_model(grown, workdir / "draft-grow-start", format="hf")
    text = workdir / "draft-grow-text"
    if not text.exists():
        shutil.copytree(workdir / "draft-gen-long-text", text)


def train(workdir: pathlib.Path, minutes: float | None) -> None:
    from specjax.train import pair
    settings = dataclasses.replace(pair.DRAFT_GEN_LONG_TRAINING, learning_rate=4e-4, seed=10)
    pair.stage_draft_gen(workdir, minutes, workdir / "draft-grow-start", config=grown_config(),
                         settings=settings, rows=pair.DRAFT_GEN_LONG_ROWS, generate_minutes=0.0,
                         run_name="draft-grow",
                         lengths=pair.long_rows(pair.DRAFT.max_position_embeddings))


def _latest(workdir: pathlib.Path):
    from specjax.train.pair import DRAFT_GEN_LONG_TRAINING, _restore
    return _restore(grown_config(), DRAFT_GEN_LONG_TRAINING, workdir / "draft-grow")


def export(workdir: pathlib.Path, out: pathlib.Path) -> None:
    """The run's latest step as a draft folder (bfloat16, the shipped draft's vocabulary file),
    for the bench and own_text_check.py."""
    import specjax as sj
    from specjax.bundle import bundled
    from specjax.checkpoint import cast
    model, step = _latest(workdir)
    sj.save_model(cast(model, "bfloat16"), out, format="hf", eos_token_id=0)
    shutil.copy(bundled("code-draft") / "draft_vocab.npy", out / "draft_vocab.npy")
    print(f"{out}: draft-grow at step {step}")


def evaluate(workdir: pathlib.Path, folders: list[str], windows: int) -> None:
    import specjax as sj
    from specjax.train.loop import loss_by_position
    heldout = np.load(workdir / "heldout.npy")
    rows = {}
    for folder in folders:
        if folder == "run":  # the run's latest checkpoint
            model, step = _latest(workdir)
            name = f"draft-grow@{step}"
        else:
            model, name = sj.load_model(folder, dtype="float32"), folder
        rows[name] = loss_by_position(model, heldout, windows=windows)
        print(name, json.dumps(rows[name]), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["start", "train", "eval", "export"])
    ap.add_argument("folders", nargs="*")
    ap.add_argument("--data", type=pathlib.Path, required=True)
    ap.add_argument("--minutes", type=float)
    ap.add_argument("--windows", type=int, default=180)
    args = ap.parse_intermixed_args(argv)
    if args.mode == "start":
        start(args.data)
    elif args.mode == "train":
        train(args.data, args.minutes)
    elif args.mode == "export":
        export(args.data, pathlib.Path(args.folders[0]))
    else:
        evaluate(args.data, args.folders, args.windows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
