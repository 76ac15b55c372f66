"""How the bundled models hold up over their context window (issue 24): held-out loss per
position bin, and a copy probe.

* Loss by position (``specjax.train.loop.loss_by_position``): the held-out token stream
  (``heldout.npy`` of ``specjax train pair data``) cut into consecutive 1,024-token windows; the
  mean next-token loss at positions 0-256, 256-512 and 512-1024 of the windows.
* Copy probe: a held-out chunk of c tokens followed by its first 64 tokens again; how often the
  model's argmax continues the copy (predicts the chunk's token j + 1 after its first j + 1
  tokens again, j = 1 .. 63), for c = 128, 256, 448 and 960: whether the model copies from its
  context, and from how far back (what n-gram and suffix drafting live on).

Both models in float32.

    python experiments/context_quality.py --data ~/specjax-work/heldout.npy \
        [--target checkpoints/code-target] [--draft checkpoints/code-draft] [--json out.json]
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import specjax as sj
from specjax.train.loop import POSITION_BINS, loss_by_position

COPY, CONTEXTS = 64, (128, 256, 448, 960)


@jax.jit
def _predictions(model, tokens):
    """tokens [B, T] -> the argmax next-token predictions [B, T - 1]."""
    return jnp.argmax(sj.model.prefill(model, tokens)[0][:, :-1], -1)


def copy_rate(model, stream: np.ndarray, chunks: int = 16, seed: int = 0) -> dict:
    """The copy probe's hit rate per context length c."""
    rng = np.random.default_rng(seed)
    out = {}
    for c in CONTEXTS:
        starts = rng.integers(0, len(stream) - c, chunks)
        seqs = np.stack([np.concatenate([stream[s:s + c], stream[s:s + COPY]]) for s in starts])
        seqs = jnp.asarray(seqs.astype(np.int32))
        predicted = _predictions(model, seqs)
        # the prediction at position c + j (the chunk's first j + 1 tokens seen again) is for
        # the token at c + j + 1, which is the chunk's token j + 1
        guess = np.asarray(predicted)[:, c + 1:c + COPY - 1]
        truth = np.asarray(seqs)[:, c + 2:c + COPY]
        out[str(c)] = float((guess == truth).mean())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="heldout.npy of `specjax train pair data`")
    ap.add_argument("--target", default=None, help="default: the bundled target")
    ap.add_argument("--draft", default=None, help="default: the bundled draft")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    stream = np.load(args.data)
    result = {}
    for name, folder in (("target", args.target or sj.bundled("code-target")),
                         ("draft", args.draft or sj.bundled("code-draft"))):
        model = sj.load_model(folder, dtype="float32")
        result[name] = {"loss_by_position": loss_by_position(model, stream),  # all windows
                        "copy_rate_by_context": copy_rate(model, stream)}
        losses, copies = result[name]["loss_by_position"], result[name]["copy_rate_by_context"]
        print(f"{name}: held-out loss by position " + ", ".join(
            f"{lo}-{hi} {losses[f'{lo}-{hi}']:.3f}" for lo, hi in POSITION_BINS)
            + f" ({losses['windows']} windows); copy rate after a chunk of "
            + ", ".join(f"{c}: {copies[str(c)]:.2f}" for c in CONTEXTS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
