"""How well a draft folder's calibration (adaptive lengths) predicts acceptance on real rounds
of a bench prompt set, against the same prediction scored on the target's own text
teacher-forced.

For each draft folder and temperature: ``sj.generate`` with every draft verified
(``survival_threshold=1e-9``, γ = 4) over the prompt set, and its ``Stats.calibration_error``
(the predictions of the verified drafts whose predecessors were accepted, against the verdicts);
then ``adaptive.acceptance_samples`` on the same prompts (the target's text, both models run once
over it), scored with the same calibration. The two agree when the engine scores what the
calibration predicts; both differ from the fit's own held-out figure when the prompts differ from
those it was fitted on.

``--heads DIR`` (heads folders with calibration.json, from ``specjax train calibrate
--heads``): real rounds only (heads draft from their own features, which teacher forcing does not
give), with the folder's calibration and with the identity (the raw confidence) beside it.

    .venv/bin/python experiments/calibration_check.py                       # checkpoints/code-draft
    .venv/bin/python experiments/calibration_check.py --draft A --draft B --prompts long
    .venv/bin/python experiments/calibration_check.py --heads checkpoints/code-eagle
"""

from __future__ import annotations

import argparse
import pathlib

import jax.numpy as jnp
import numpy as np

import specjax as sj
from specjax import adaptive
from specjax.bench import load_prompts

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", action="append", help="draft folder(s) with calibration.json "
                    "(default: checkpoints/code-draft)")
    ap.add_argument("--heads", action="append", default=[],
                    help="Medusa / EAGLE folder(s) with calibration.json (real rounds only)")
    ap.add_argument("--prompts", default="short", help="a bench prompt set (short, long, a file)")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    target = sj.load_model(ROOT / "checkpoints" / "code-target")
    tok = sj.load_tokenizer(ROOT / "checkpoints" / "code-target")
    prompts = [tok.encode(p["text"]) for p in load_prompts(args.prompts)]
    for folder in args.heads:
        heads = sj.load_heads(folder, target)
        if "calibration" not in heads.params:
            raise SystemExit(f"{folder} has no calibration.json")
        for t in map(float, args.temperatures.split(",")):
            ece = {}
            for name, d in (("fitted", heads), ("raw", adaptive._uncalibrated(heads))):
                out = sj.generate(target, prompts, draft=d, sampling=sj.SamplingParams(
                    temperature=t, max_new_tokens=args.max_new_tokens), spec=sj.SpecConfig(
                    method=heads.config.method, num_speculative_tokens=4,
                    survival_threshold=1e-9))
                rel = out.stats.reliability
                n = sum(c for _, _, c in rel)
                ece[name] = (out.stats.calibration_error, sum(p * k for p, _, k in rel) / n,
                             sum(a * k for _, a, k in rel) / n, n)
            (f, fp, acc, n), (r, rp, _, _) = ece["fitted"], ece["raw"]
            print(f"{folder} T={t:g}: real rounds ECE {f:.3f} with its calibration (mean "
                  f"predicted {fp:.3f}), {r:.3f} raw (mean confidence {rp:.3f}); accepted "
                  f"{acc:.3f}, {n} drafts")
    for folder in args.draft or ([] if args.heads else
                                 [str(ROOT / "checkpoints" / "code-draft")]):
        draft = sj.load_draft_model(folder)
        if draft.calibration is None:
            raise SystemExit(f"{folder} has no calibration.json fitted for its weights")
        for t in map(float, args.temperatures.split(",")):
            out = sj.generate(target, prompts, draft=draft,
                              spec=sj.SpecConfig(num_speculative_tokens=4, survival_threshold=1e-9),
                              sampling=sj.SamplingParams(temperature=t,
                                                         max_new_tokens=args.max_new_tokens))
            rel = out.stats.reliability
            n = sum(c for _, _, c in rel)
            c, y, _ = adaptive.acceptance_samples(target, draft, prompts, temperature=t,
                                                  max_new_tokens=args.max_new_tokens)
            pred = np.asarray(draft.calibration.predict(jnp.asarray(c),
                                                        jnp.full(len(c), t == 0)))
            print(f"{folder} T={t:g}: real rounds ECE {out.stats.calibration_error:.3f} "
                  f"(mean predicted {sum(p * k for p, _, k in rel) / n:.3f}, accepted "
                  f"{sum(a * k for _, a, k in rel) / n:.3f}, {n} drafts); teacher-forced ECE "
                  f"{adaptive.expected_calibration_error(pred, y):.3f} (mean predicted "
                  f"{pred.mean():.3f}, accepted {y.mean():.3f}, {len(y)} positions)")


if __name__ == "__main__":
    main()
