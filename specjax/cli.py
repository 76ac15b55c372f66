"""The ``specjax`` command.

    specjax demo     speculative vs autoregressive decoding on small random models, no downloads
    specjax generate --prompt TEXT [--target DIR --draft DIR --method ...] [--compare]
    specjax bench    [--gammas 2,4,6 --temperatures 0,0.8 --json PATH]   held-out prompt table
    specjax train pair {data,target,target-long,draft,...,export}   the bundled pair

``generate`` and ``bench`` default to the bundled pair (``sj.bundled``: the repository's
checkpoints/, or the copy a wheel carries).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys

import jax
import numpy as np

from . import shapes, theory
from .bench import lookup_options, parted_at_near_tie
from .bundle import bundled
from .checkpoint import DTYPES
from .config import ModelConfig, SamplingParams, SpecConfig
from .draft import names as draft_methods
from .engine import generate, stream, warmup
from .model import Model, init_model

DTYPE_HELP = ("compute dtype; auto (the default, as in sj.load_model): float32 on CPU, the "
              "checkpoint's dtype (bfloat16 for the bundled pair) on GPU and TPU; stored: the "
              "checkpoint's dtype everywhere")

DEMO_TARGET = ModelConfig(vocab_size=4096, hidden_size=384, intermediate_size=1024,
                          num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
                          max_position_embeddings=1024)


def demo_target(key) -> Model:
    """A random stand-in for a trained target: a sharpened LM head (so next-token distributions
    are peaked, as a trained model's are) and layers after the first that only make small
    corrections (residual outputs scaled by 0.02), so its first layer predicts it fairly well."""
    model = init_model(DEMO_TARGET, key)
    params = jax.tree.map(lambda x: x, model.params)
    layer_scale = np.concatenate([[1.0], np.full(DEMO_TARGET.num_hidden_layers - 1, 0.02)])
    for i, scale in enumerate(layer_scale):
        layer = params["layers"][str(i)]
        for block, proj in [("self_attn", "o_proj"), ("mlp", "down_proj")]:
            kernel = layer[block][proj]["kernel"]
            layer[block][proj] = {"kernel": kernel * float(scale)}
    params["lm_head"] = {"kernel": params["lm_head"]["kernel"] * 25}
    return Model(DEMO_TARGET, params)


def first_layers(model: Model, n: int) -> Model:
    """The model's first n layers with its own embedding, final norm and head: a layer-skip
    (self-speculative) draft that needs no training and no second vocabulary."""
    c = model.config
    config = dataclasses.replace(c, num_hidden_layers=n, layer_types=None if c.layer_types is None
                                 else c.layer_types[:n])
    params = dict(model.params)
    params["layers"] = {str(i): params["layers"][str(i)] for i in range(n)}
    return Model(config, params)


def _ratio(spec_stats, ar_stats) -> str:
    """Speculative decode speed over autoregressive's, or "n/a" when either decoded nothing
    after its first token (max_new_tokens 1: a decode speed of 0)."""
    if not (spec_stats.decode_tokens_per_second > 0 and ar_stats.decode_tokens_per_second > 0):
        return "n/a (nothing decoded after the first token)"
    return f"{spec_stats.decode_tokens_per_second / ar_stats.decode_tokens_per_second:.2f}x"


def _in_flag_words(message: str, command: argparse.ArgumentParser) -> str:
    """An error about a setting (``SamplingParams.top_p must be ...``) named by the flag that
    set it (``--top-p must be ...``), where the subcommand has that flag."""
    flags = {a.dest: a.option_strings[-1] for a in command._actions if a.option_strings}
    return re.sub(r"\b(?:SamplingParams|SpecConfig)\.(\w+)",
                  lambda m: flags.get(m.group(1), m.group(0)), message)


def _demo(args) -> int:
    prompts = [[1, 17, 42, 99, 7, 300]]  # batch 1: the latency case speculation is for
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens)
    spec = SpecConfig(method="draft_model", num_speculative_tokens=args.num_speculative_tokens)
    target = demo_target(jax.random.key(args.seed))
    draft = first_layers(target, args.draft_layers)
    print(f"target: random {DEMO_TARGET.num_params / 1e6:.1f}M-parameter Llama-style model, "
          f"{DEMO_TARGET.num_hidden_layers} layers (random weights; `specjax generate` runs "
          f"the bundled trained pair)")
    print(f"draft:  its first {args.draft_layers} layer(s) with the same embedding and head "
          f"(layer-skip self-speculation)")
    print(f"batch of {len(prompts)}, {args.max_new_tokens} new tokens, "
          f"temperature {args.temperature}, gamma {args.num_speculative_tokens}\n")
    runs = {}
    for name, kw in [("autoregressive", {}), ("speculative", dict(spec=spec, draft=draft))]:
        generate(target, prompts, sampling=sampling, key=args.seed, **kw)  # compile once
        best = None
        for _ in range(args.repeats):
            out = generate(target, prompts, sampling=sampling, key=args.seed, **kw)
            if best is None or out.stats.decode_seconds < best.stats.decode_seconds:
                best = out
        runs[name] = best
    ar, sp = runs["autoregressive"], runs["speculative"]
    s = sp.stats
    print(f"{'':16}{'tokens/s':>10}{'TTFT ms':>9}{'rounds':>8}")
    for name, out in runs.items():
        print(f"{name:16}{out.stats.decode_tokens_per_second:10.0f}"
              f"{out.stats.prefill_seconds * 1e3:9.1f}{out.stats.num_rounds:8d}")
    print(f"\nspeed-up {_ratio(s, ar.stats)} (best of {args.repeats}, same run)")
    print(f"acceptance rate {s.acceptance_rate:.3f}, mean accepted length "
          f"{s.mean_accepted_length:.2f} tokens/round")
    print("per-position acceptance " + " ".join(f"{a:.2f}" for a in s.per_position_acceptance))
    c = args.draft_layers / DEMO_TARGET.num_hidden_layers
    if s.alpha == s.alpha:  # nan: no round verified a draft (max_new_tokens 1)
        print(f"theory at this acceptance (alpha {s.alpha:.3f}, c ~ {c:.2f} by layer count): "
              f"{theory.speedup(s.alpha, args.num_speculative_tokens, c):.2f}x")
    if args.temperature == 0:
        same = np.array_equal(ar.tokens, sp.tokens)
        print(f"greedy output identical to autoregressive: {same}")
        if not same:
            return 1
    print("\nfirst row:", " ".join(map(str, sp.tokens[0, :24])), "...")
    return 0




def _speculative_config(text: str, draft: str | None) -> tuple[SpecConfig, str | None]:
    """--speculative-config as vLLM takes it: JSON, whose "model" key (if any) names the draft
    folder (as --draft does). Returns the SpecConfig and the draft folder."""
    import json
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {text!r} ({e})") from None
    if isinstance(config, dict) and "model" in config:
        config = dict(config)
        model = config.pop("model")
        if not isinstance(model, str) or not model:
            raise ValueError(f"--speculative-config's \"model\" must be a draft folder path, "
                             f"got {model!r}")
        if draft is not None and draft != model:
            raise ValueError(f"--speculative-config names the draft {model!r} and --draft "
                             f"names {draft!r}: give one")
        draft = model
    return SpecConfig.parse(config), draft


def _unescape(text: str, flag: str = "--stop") -> str:
    """A command-line string with Python escapes (\\n, \\t, \\u00e9) read; other characters
    kept as typed. ValueError naming ``flag`` for a broken escape."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {text!r}: a bad escape ({e.reason})") from None


def _generate(args) -> int:
    from .checkpoint import load_model
    from .tokenizer import load_tokenizer
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.speculative_config:
        spec, args.draft = _speculative_config(args.speculative_config, args.draft)
    elif args.method == "none":
        spec = None
    else:
        spec = SpecConfig(method=args.method, num_speculative_tokens=args.num_speculative_tokens,
                          acceptance_floor=args.acceptance_floor, **lookup_options(args))
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens,
                              stop=[_unescape(x) for x in args.stop] if args.stop else None)
    if args.compare and spec is None:
        raise ValueError("--compare sets speculative decoding beside autoregressive decoding: "
                         "give a speculative --method (got none)")
    if args.draft and not (spec is not None and (spec.needs_draft_model or spec.needs_heads)):
        raise ValueError(f"--draft {args.draft}: method "
                         f"{'none' if spec is None else repr(spec.method)} drafts without a "
                         f"model; drop --draft")
    from .engine import _as_key
    _as_key(args.seed)  # a bad seed is refused before anything loads or compiles
    target = load_model(args.target, dtype=args.dtype)
    tok = load_tokenizer(args.target)
    if not tok.encode(args.prompt):
        raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens")
    draft = None
    if spec is not None and spec.needs_draft_model:
        from .draft.draft_model import load_paired_draft
        draft = load_paired_draft(args.draft or bundled("code-draft"), tok,
                                  target.config.vocab_size, args.dtype,
                                  full_vocab=args.full_draft_vocab,
                                  level=args.draft_tokenizer_level)
    elif spec is not None and spec.needs_heads:
        from .draft import load_heads
        draft = load_heads(args.draft or bundled(f"code-{spec.method}"), target)
    from .engine import build_proposer, check_request
    check_request(target, [args.prompt], sampling, tok, True)  # its length, before compiling
    if spec is not None:  # the method's own checks of its draft, before anything compiles
        try:
            build_proposer(spec, None, draft, target.config)  # what generate builds first
        except ValueError as e:
            where = (f"--draft {args.draft}" if args.draft else
                     f"the default draft of --method {spec.method} (a bundled one, for the "
                     f"bundled target; give --draft DIR)")
            raise ValueError(f"{where}: {e}") from None
    runs = [("speculative" if spec else "autoregressive", spec, draft)]
    if args.compare and spec is not None:
        runs.append(("autoregressive", None, None))
    calls = {name: functools.partial(generate, target, [args.prompt], sampling=sampling, spec=s,
                                     draft=d, key=args.seed, tokenizer=tok, return_text=True,
                                     max_cache_len=args.max_cache_len)
             for name, s, d in runs}
    compile_seconds = {}
    for name, s, d in runs:  # compiling takes seconds: say so instead of staying silent
        print(f"compiling the {name} program...", end="", file=sys.stderr, flush=True)
        _PROGRESS[0] = True  # a refusal from here on starts a line of its own
        done = warmup(target, prompt_tokens=len(tok.encode(args.prompt)), sampling=sampling,
                      spec=s, draft=d, max_cache_len=args.max_cache_len,
                      stream=name == runs[0][0] and not args.no_stream)
        compile_seconds[name] = done.compile_seconds
        print(f" done in {done.compile_seconds:.1f} s (cache capacity {done.capacity} tokens)",
              file=sys.stderr, flush=True)
        _PROGRESS[0] = False
    shown_name = runs[0][0]
    first = {}
    if not args.no_stream:  # the shown run's text as it is written, then the others
        print(args.prompt, end="", flush=True)
        for chunk in stream(target, [args.prompt], **calls[shown_name].keywords):
            print(chunk.text[0], end="", flush=True)
        print("\n")
        first[shown_name] = chunk.generation
    first.update({name: call() for name, call in calls.items() if name not in first})
    first = {name: dataclasses.replace(out, stats=dataclasses.replace(
        out.stats, compile_seconds=compile_seconds[name])) for name, out in first.items()}
    results = first
    if args.compare:
        # The first run of a freshly compiled program pays one-off costs that are not compile
        # time (allocations, thread start-up), and one pass is at this machine's mercy: time
        # --repeats passes of each, interleaved, and keep each one's median pass.
        passes = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, call in calls.items():
                passes[name].append(call())
        results = {}
        for name, outs in passes.items():
            median = sorted(outs, key=lambda o: o.stats.decode_seconds)[len(outs) // 2]
            results[name] = dataclasses.replace(median, stats=dataclasses.replace(
                median.stats, compile_seconds=first[name].stats.compile_seconds))
    if args.no_stream:
        print(args.prompt + results[shown_name].text[0])
        print()
    for name, out in results.items():
        st = out.stats
        streamed = " (streamed: a host read per chunk of rounds)" if (
            name == shown_name and not args.no_stream and not args.compare) else ""
        line = (f"[{name}] {out.lengths[0]} tokens, {st.decode_tokens_per_second:.1f} "
                f"tokens/s{streamed}, "
                f"TTFT {st.prefill_seconds * 1e3:.1f} ms, compile {st.compile_seconds:.1f} s")
        if out.stats.proposed_tokens:
            line += (f", acceptance rate {st.acceptance_rate:.3f}, mean accepted length "
                     f"{st.mean_accepted_length:.2f}")
        print(line)
    mapped = getattr(draft, "from_target", None) is not None
    if mapped:  # how much the tokens the draft shares with the target carry on this text
        from .draft import vocab_coverage
        out = results[shown_name]
        cover = vocab_coverage(target, draft, [tok.encode(args.prompt)
                                               + [int(t) for t in out.tokens[0, :out.lengths[0]]]])
        print(f"draft tokenizer: {cover['shared_tokens']} tokens shared with the target's; on "
              f"this text they carry {cover['target_mass']:.3f} of the target's probability "
              f"and {cover['draft_mass']:.3f} of the draft's")
    if len(results) == 2:
        ar, sp = results["autoregressive"], results["speculative"]
        same = np.array_equal(ar.tokens, sp.tokens)
        print(f"speed-up {_ratio(sp.stats, ar.stats)}"
              f" (median of {args.repeats} interleaved passes each)"
              + (f"; output identical: {same}" if args.temperature == 0 else ""))
        if args.temperature == 0 and not same:
            at_tie = parted_at_near_tie(target, tok.encode(args.prompt), ar.tokens[0],
                                        sp.tokens[0])
            print("(the texts part at a near tie, within " + target.config.dtype + " rounding: "
                  "there a verify forward and a one-token step may choose apart)" if at_tie else
                  "(the texts part where the target's choice is clear: not rounding; please "
                  "report this)")
            if not at_tie:
                return 1
    return 0


def _add_lookup(parser) -> None:
    """The n-gram lookup flags, shared by generate and bench (see ``lookup_options``)."""
    parser.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram (default 2)")
    parser.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram (default 4)")
    parser.add_argument("--prompt-lookup-length-factor", type=float, default=None, metavar="F",
                        help="ngram: a match of n tokens proposes at most ceil(F x n) drafts "
                             "(default: up to GAMMA)")
    parser.add_argument("--acceptance-floor", type=float, default=None, metavar="F",
                        help="ngram, suffix: a row proposes only while its running rate of "
                             "first drafts accepted is at least F (default 0.2; 0: always)")
    parser.add_argument("--lookahead-window", type=int, default=None, metavar="W",
                        help="lookahead: the Jacobi window's columns (default 1); its n-grams "
                             "are GAMMA + 1 long")
    parser.add_argument("--lookahead-candidates", type=int, default=None, metavar="G",
                        help="lookahead: candidate chains verified a round (default 1)")


def _add_generate(sub) -> None:
    g = sub.add_parser("generate",
                       help="complete a prompt, speculatively (default: the bundled pair)",
                       description="Complete a prompt with a target model, speculatively, and "
                                   "print the completion and the acceptance and speed figures.")
    g.add_argument("--prompt", default="def fibonacci(n):")
    g.add_argument("--repeats", type=int, default=3,
                   help="with --compare: timed passes of each, interleaved (median shown)")
    g.add_argument("--target",
                   help="any sj.load_model folder holding a tokenizer.json (default: the bundled "
                        "code-target)")
    g.add_argument("--draft",
                   help="draft model folder for --method draft_model, heads folder for medusa / "
                        "eagle / dflash / mtp (default: the bundled code-draft, "
                        "code-medusa, code-eagle, code-dflash, code-mtp)")
    g.add_argument("--full-draft-vocab", action="store_true",
                   help="draft over the whole vocabulary even when the draft folder ships a "
                        "draft vocabulary (draft_vocab.npy; the bundled draft does)")
    g.add_argument("--draft-tokenizer-level", choices=["token", "string"], default="token",
                   help="a --draft folder with a tokenizer of its own: draft the tokens the two "
                        "share (token, default) or draft text in the draft's own tokens and cut "
                        "it into target tokens (string; chains only)")
    g.add_argument("--method", default="draft_model",
                   choices=[*draft_methods(), "none"],
                   help="how drafts are made; none = plain autoregressive decoding")
    g.add_argument("--num-speculative-tokens", type=int, default=4, metavar="GAMMA")
    _add_lookup(g)
    g.add_argument("--speculative-config", metavar="JSON",
                   help='vLLM style, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; '
                        "overrides --method and --num-speculative-tokens")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--max-cache-len", type=int, default=None, metavar="SLOTS",
                   help="cache slots per row (default: the smallest capacity tier that holds "
                        "the request)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    g.add_argument("--compare", action="store_true",
                   help="also run plain autoregressive decoding and print the speed-up")
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="end the completion before this text (repeat for several; Python "
                        "escapes such as \\n are read)")
    g.add_argument("--no-stream", action="store_true",
                   help="print the completion when it is done instead of as it is written")


def _numbers(kind, allow_empty: bool = False):
    def parse(text: str):
        items = [x.strip() for x in text.split(",")] if text.strip() else []
        if "" in items:
            raise argparse.ArgumentTypeError(f"an empty item in {text!r}")
        try:
            values = [kind(x) for x in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, "
                                             f"got {text!r}") from None
        if not values and not allow_empty:
            raise argparse.ArgumentTypeError(f"expected at least one value, got {text!r}")
        if len(set(values)) < len(values):
            raise argparse.ArgumentTypeError(f"a value given twice in {text!r}")
        return values
    return parse


def _methods(text: str) -> list[str]:
    METHODS = draft_methods()
    methods = [m.strip() for m in text.split(",")]
    if "" in methods or len(set(methods)) < len(methods):
        raise argparse.ArgumentTypeError(f"an empty item or a method given twice in {text!r}")
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise argparse.ArgumentTypeError(f"unknown method(s) {bad or text!r}; known: "
                                         f"{', '.join(METHODS)}")
    return methods


def _add_bench(sub) -> None:
    from .bench import __doc__ as bench_doc
    b = sub.add_parser("bench", help="speculative vs autoregressive on held-out prompts: a table",
                       description=bench_doc,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--target",
                   help="any sj.load_model folder holding a tokenizer.json (default: the bundled "
                        "code-target)")
    b.add_argument("--target-shape", choices=shapes.names(), metavar="NAME",
                   help="instead of --target: random weights in the shape of a common model ("
                        + ", ".join(shapes.names()) + "), with a one-layer draft and fresh "
                        "heads, random prompts and synthetic acceptance (0.8 unless "
                        "--synthetic-acceptance): NOT LOSSLESS, benchmark only")
    b.add_argument("--draft",
                   help="draft model folder for --method draft_model (default: the bundled "
                        "code-draft)")
    b.add_argument("--full-draft-vocab", action="store_true",
                   help="draft over the whole vocabulary even when the draft folder ships a "
                        "draft vocabulary (draft_vocab.npy; the bundled draft does)")
    b.add_argument("--draft-tokenizer-level", choices=["token", "string"], default="token",
                   help="a --draft folder with a tokenizer of its own: draft the tokens the two "
                        "share (token, default) or draft text in the draft's own tokens and cut "
                        "it into target tokens (string; chains only)")
    b.add_argument("--method", type=_methods, default=["draft_model"], metavar="M,M,...",
                   help=f"draft methods to compare in one run: {', '.join(draft_methods())} "
                        f"(default draft_model)")
    b.add_argument("--medusa",
                   help="Medusa heads folder (default: the bundled code-medusa)")
    b.add_argument("--eagle", help="EAGLE head folder (default: the bundled code-eagle)")
    b.add_argument("--dflash",
                   help="block drafter folder (default: the bundled code-dflash)")
    b.add_argument("--mtp", help="MTP modules folder (default: the bundled code-mtp)")
    b.add_argument("--suffix-cache", type=int, metavar="TOKENS",
                   help="suffix: a SuffixCache of this many tokens that each pass over the "
                        "prompts starts empty and fills with the outputs, in order (default: "
                        "none, each row's own text only); with --prompts "
                        "specjax/data/repeat_prompts.json, requests that repeat earlier ones")
    b.add_argument("--gammas", type=_numbers(int, allow_empty=True), default=[2, 4, 6],
                   metavar="G,G,...", help="chains of this many drafts to compare (default "
                                           "2,4,6; '' for none, e.g. with --tree)")
    _add_lookup(b)
    b.add_argument("--tree", action="append", metavar="JSON",
                   help="also a static draft tree, vLLM's speculative_token_tree format, e.g. "
                        "'[[0],[1],[0,0]]' (repeatable; for every method but ngram and mtp)")
    b.add_argument("--synthetic-acceptance", type=_numbers(float), default=None,
                   metavar="A[,A,...]",
                   help="BENCHMARK ONLY, NOT LOSSLESS: every chain accepts draft position i with "
                        "probability A (or the i-th A, one per position), whatever the drafts; "
                        "for measuring at a known acceptance (random weights, accelerators)")
    b.add_argument("--suffix-own-spec-factor", type=_numbers(float), default=None,
                   metavar="F[,F,...]",
                   help="suffix: each chain once per factor, where the longest match lies in "
                        "the row's own text (SpecConfig.suffix_decoding_own_spec_factor)")
    b.add_argument("--survival-threshold", type=_numbers(float), default=None,
                   metavar="S[,S,...]",
                   help="also each chain with adaptive lengths at these thresholds "
                        "(SpecConfig.survival_threshold; methods that support it)")
    b.add_argument("--temperatures", type=_numbers(float), default=[0.0, 0.8], metavar="T,T,...",
                   help="sampling temperatures, 0 = greedy (default 0,0.8)")
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=3, help="timed passes per variant (median)")
    b.add_argument("--verify-repeats", type=int, default=20,
                   help="samples of each part's timing (step, verify forward, each variant's "
                        "propose and round), spread over the repeats")
    b.add_argument("--num-prompts", type=int, help="use only the first N prompts")
    b.add_argument("--max-prompt-tokens", type=int,
                   help="keep only the last N tokens of each prompt (default: whole prompts)")
    b.add_argument("--prompts", help='"short" (the default) or "long": the shipped held-out sets '
                                     "(long: 300-900 tokens); or a JSON file "
                                     '{"prompts": [{"text": ...}, ...]}')
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    b.add_argument("--roofline", action="store_true",
                   help="also print the AR step's weight bytes per second against this "
                        "machine's measured memory bandwidth, and the target's forward over "
                        "1..16 tokens against bandwidth and peak FLOPs (sj.roofline)")
    b.add_argument("--roofline-batches", type=_numbers(int), default=[1], metavar="B,B,...",
                   help="batches of the --roofline report (default 1; e.g. 1,8,32)")
    b.add_argument("--batch-size", type=_numbers(int), default=[1], metavar="B[,B,...]",
                   help="rows per generate call (default 1); several: one bench per batch size, "
                        "in one process")
    b.add_argument("--verify-budget", action="store_true",
                   help="also each adaptive chain with the batch's verify budget, its costs "
                        "measured at each batch size (SpecConfig.verify_costs)")
    b.add_argument("--without-rests", action="store_true",
                   help="with --verify-budget: each budget variant also without rests "
                        "(SpecConfig.idle_rounds=0), in the same repeats")
    b.add_argument("--plot", "--plots", dest="plots", metavar="DIR",
                   help="write PNG figures there (matplotlib): speed-up against γ, per-position "
                        "acceptance, TPOT distributions, speed-up against batch size, and the "
                        "reliability diagram of adaptive variants")
    b.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")


def _default_models(args) -> None:
    """Fill in the bundled models for the folders not given (a clear error when this install
    has none)."""
    if args.target is None:
        args.target = str(bundled("code-target"))


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Say each option's default in --help, in this parser and its subcommands, unless its help
    already speaks of one, or it has none to say (None, a flag that is off, an empty list)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                show_defaults(child)
            continue
        default = action.default
        if (not action.option_strings or any(default is x for x in (None, False))
                or default == argparse.SUPPRESS
                or isinstance(default, (list, tuple)) and not default
                or "default" in (action.help or "")):
            continue
        action.help = (f"{action.help} " if action.help else "") + "(default: %(default)s)"
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The ``specjax`` argument parser (``train`` is dispatched before it parses)."""
    parser = argparse.ArgumentParser(
        prog="specjax", description="Lossless speculative decoding in JAX.")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"specjax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="speculative vs autoregressive on small random models",
                          description="Runs a random target and a layer-skip draft of it, "
                                      "autoregressive and speculative, and compares them.")
    demo.add_argument("--num-speculative-tokens", type=int, default=4, metavar="GAMMA")
    demo.add_argument("--draft-layers", type=int, default=1)
    demo.add_argument("--temperature", type=float, default=0.0)
    demo.add_argument("--top-k", type=int, default=0)
    demo.add_argument("--top-p", type=float, default=1.0)
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.add_argument("--repeats", type=int, default=3)
    demo.add_argument("--seed", type=int, default=0)
    _add_generate(sub)
    _add_bench(sub)
    sub.add_parser("train", add_help=False,
                   help="train models (`specjax train pair --help`, `specjax train heads --help`, "
                        "`specjax train calibrate --help`)")
    return show_defaults(parser)


TRAIN_HELP = """usage: specjax train {pair,heads,calibrate} ...

  specjax train pair {data,target,target-long,draft,draft-long,draft-gen,draft-gen-long,
                      export,draft-bpe4k,draft-bpe4k-kd,draft-bpe4k-soft,export-bpe4k,
                      export-bpe4k-soft} --workdir DIR
      build the bundled target/draft pair (resumable); `specjax train pair --help`
  specjax train heads {medusa,eagle,dflash,mtp} --workdir DIR
      train drafting heads on a target; `specjax train heads --help`
  specjax train calibrate {--draft,--heads} DIR --data DIR
      fit a drafter's confidence calibration; `specjax train calibrate --help`"""


_PROGRESS = [False]  # whether stderr is in the middle of a "compiling ..." line


def _end_progress_line() -> None:
    if _PROGRESS[0]:
        print(file=sys.stderr, flush=True)
        _PROGRESS[0] = False


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["train", "heads"]:
        from .train.heads import heads_main
        return heads_main(argv[2:])
    if argv[:2] == ["train", "calibrate"]:
        from .adaptive import calibrate_main
        return calibrate_main(argv[2:])
    if argv[:2] == ["train", "pair"]:
        from .train.pair import main as pair_main
        return pair_main(argv[2:])
    if argv[:1] == ["train"]:
        if argv[1:2] in (["-h"], ["--help"]):
            print(TRAIN_HELP)
            return 0
        parser.error("specjax train needs one of pair, heads, calibrate (got "
                     + (repr(argv[1]) if argv[1:] else "none") + ")\n" + TRAIN_HELP)
    args = parser.parse_args(argv)
    # errors in the words of the subcommand's own parser ("specjax bench: error: ...")
    command = next((a.choices[args.command] for a in parser._actions
                    if isinstance(a, argparse._SubParsersAction)
                    and args.command in a.choices), parser)
    if args.command == "generate":
        try:
            _default_models(args)
            return _generate(args)
        except (ValueError, OSError) as e:
            _end_progress_line()
            command.error(_in_flag_words(str(e), command))
    if args.command == "bench":
        from .bench import main as bench_main
        try:
            return bench_main(args)
        except (ValueError, OSError) as e:
            command.error(_in_flag_words(str(e), command))
    if args.command == "demo":
        if args.repeats < 1:
            command.error(f"--repeats must be >= 1, got {args.repeats}")
        if not 1 <= args.draft_layers < DEMO_TARGET.num_hidden_layers:
            command.error(f"--draft-layers must be in [1, {DEMO_TARGET.num_hidden_layers - 1}], "
                          f"got {args.draft_layers}")
        try:
            return _demo(args)
        except ValueError as e:
            command.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
