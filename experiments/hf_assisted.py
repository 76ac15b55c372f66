"""specjax vs Hugging Face assisted generation on the same HF-format target/draft pair, greedy.

The pair is the `specjax demo` pair exported to Hugging Face format (a random 15.7M target and its
own first layer as the draft). Both libraries load the same
folders; the script checks that the outputs are identical and prints tokens/s for each, with
plain greedy decoding in each library as the baseline, all in one run.

    .venv/bin/python experiments/hf_assisted.py [--max-new-tokens 96] [--gamma 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import jax
import numpy as np
import torch
import transformers

import specjax as sj
from specjax import cli, timing


def hf_run(model, prompt, n, **kw):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out, seconds = timing.timed(
            model.generate, ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
            min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(prompt):].numpy(), seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    folder = pathlib.Path(tmp.name)
    target = cli.demo_target(jax.random.key(0))
    sj.save_model(target, folder / "target", format="hf")
    sj.save_model(cli.first_layers(target, 1), folder / "draft", format="hf")

    ours_t, ours_d = sj.load_model(folder / "target"), sj.load_model(folder / "draft")
    hf_t = transformers.AutoModelForCausalLM.from_pretrained(folder / "target").eval()
    hf_d = transformers.AutoModelForCausalLM.from_pretrained(folder / "draft").eval()
    prompt, n = [1, 17, 42, 99, 7, 300], args.max_new_tokens
    greedy = sj.SamplingParams(temperature=0, max_new_tokens=n)
    spec = sj.SpecConfig(num_speculative_tokens=args.gamma)

    runs = {name: [] for name in ("hf greedy", "hf assisted", "specjax greedy",
                                  "specjax speculative")}
    outputs = {}
    for _ in range(args.repeats + 1):  # the first round warms up (compiles, allocates)
        tok, s = hf_run(hf_t, prompt, n)
        runs["hf greedy"].append(s), outputs.setdefault("hf greedy", tok)
        tok, s = hf_run(hf_t, prompt, n, assistant_model=hf_d, num_assistant_tokens=args.gamma,
                        num_assistant_tokens_schedule="constant")
        runs["hf assisted"].append(s), outputs.setdefault("hf assisted", tok)
        for name, kw in [("specjax greedy", {}),
                         ("specjax speculative", dict(spec=spec, draft=ours_d))]:
            out, seconds = timing.timed(sj.generate, ours_t, [prompt], sampling=greedy, **kw)
            seconds -= out.stats.compile_seconds
            runs[name].append(seconds)
            outputs.setdefault(name, out.tokens[0])
    ref = outputs["hf greedy"]
    print(f"pair: the random demo target {ours_t.config.num_params / 1e6:.1f}M, draft = its "
          f"first layer, in HF format; prompt of {len(prompt)} tokens, {n} new tokens, greedy, "
          f"gamma "
          f"{args.gamma}, best of {args.repeats} after a warm-up")
    print(f"{'':22}{'tokens/s':>10}{'vs hf greedy':>14}  output == hf greedy")
    base = n / min(runs["hf greedy"][1:])
    for name, seconds in runs.items():
        rate = n / min(seconds[1:])
        print(f"{name:22}{rate:10.0f}{rate / base:13.2f}x  {np.array_equal(outputs[name], ref)}")
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers "
          f"{transformers.__version__}, jax {jax.__version__}")
    tmp.cleanup()
    if not all(np.array_equal(o, ref) for o in outputs.values()):
        raise SystemExit("outputs differ")


if __name__ == "__main__":
    main()
