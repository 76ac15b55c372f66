"""Tiny models and numpy references shared by the tests."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re

import fast_compile

# One on-disk XLA compilation cache for every test process: the pytest-xdist workers, the
# subprocesses the sharding tests start (they inherit the environment) and later runs. A program
# compiled again (in another process, or after a test cleared the caches to patch traced code) is
# read back instead of compiled; patched code traces to other HLO and so to other entries.
# Set before jax is imported, so jax reads it from the environment.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(__file__).resolve().parents[1] / ".pytest_cache" / "xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The suite compiles hundreds of small programs: tests/fast_compile.py says how they compile
# faster. Set before jax is imported.
os.environ["XLA_FLAGS"] = fast_compile.xla_flags(os.environ.get("XLA_FLAGS", ""))
# Each pytest-xdist worker on its own cores (tests/fast_compile.py says why), before jax starts
# its threads.
fast_compile.pin_xdist_worker()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import specjax as sj  # noqa: E402
from specjax import engine  # noqa: E402

# The files that take longest on CI's two workers, run first (seconds of a fresh-clone CI run,
# 2026-12-06; every file over half a minute): with each file on one worker (--dist loadfile),
# the longest-first order leaves short files for the end, so the two workers finish about
# together. xdist's own order (most tests first; .ci/run turns it off) put the two longest
# single tests, the notebook and the sharded suite, last. Only the order changes.
LONGEST_FILES = {"test_adaptive.py": 244, "test_lossless.py": 185, "test_sharding.py": 178,
                 "test_docs_and_cli.py": 172, "test_heads.py": 170, "test_dflash.py": 119,
                 "test_mtp.py": 102, "test_bundled.py": 99, "test_string_drafts.py": 92,
                 "test_engine.py": 92, "test_capacity.py": 83, "test_notebook.py": 74,
                 "test_tree.py": 72, "test_draft_vocab.py": 69, "test_ring.py": 59,
                 "test_train.py": 52, "test_fuzz.py": 52, "test_crash_safety.py": 49,
                 "test_suffix.py": 47, "test_stop.py": 46, "test_synthetic.py": 41,
                 "test_families.py": 41, "test_spelled_draft.py": 40, "test_gate.py": 40,
                 "test_attention.py": 35, "test_lookahead.py": 31, "test_checkpoint.py": 34}


def pytest_collection_modifyitems(items):
    """Files in LONGEST_FILES first, longest first; the rest after them as collected; each
    file's tests in their own order."""
    def rank(indexed):
        i, item = indexed
        return -LONGEST_FILES.get(item.path.name, 0), i
    items[:] = [item for _, item in sorted(enumerate(items), key=rank)]


@contextlib.contextmanager
def traces_and_compiles():
    """A list that collects the traces and compiles JAX reports while the block runs (a jitted
    function built afresh per call traces again; a program missing from every cache compiles)."""
    from jax._src import dispatch
    seen = []

    def listen(event, duration, **_):
        if event in (dispatch.JAXPR_TRACE_EVENT, dispatch.BACKEND_COMPILE_EVENT):
            seen.append(event)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def tiny_config(vocab_size=16, hidden_size=16, layers=2, heads=2, kv_heads=1, max_pos=64, **kw):
    return sj.ModelConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                          intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv_heads,
                          max_position_embeddings=max_pos, **kw)


def tiny_model(seed=0, init_std=0.5, **kw) -> sj.Model:
    """A random model whose next-token distributions are far from uniform (init_std 0.5)."""
    return sj.init_model(tiny_config(**kw), jax.random.key(seed), init_std=init_std)


def perturbed(params, key: int, scale: float):
    """Every leaf of ``params`` plus ``scale`` times its own standard normal noise: of a target's
    parameters, a draft whose drafts are often accepted and often not (a greedy test with a
    small random draft may accept almost nothing, and a speculative path then barely runs)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(key), len(leaves))
    return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype)
                                     for x, k in zip(leaves, keys)])


@pytest.fixture(scope="session")
def target():
    return tiny_model(seed=0, vocab_size=32, hidden_size=32, layers=2, heads=4, kv_heads=2,
                      max_pos=128)


@pytest.fixture(scope="session")
def draft():
    return tiny_model(seed=1, vocab_size=32, hidden_size=16, layers=1, heads=2, kv_heads=1,
                      max_pos=128)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. Each compiled program holds about
    860 memory mappings (LLVM's JIT sections; measured for a small generate program), and Linux
    allows a process 65,530 (vm.max_map_count): a pytest-xdist worker that kept every program
    of every file it ran crashed inside XLA's compilation-cache write (segfault, after LLVM's
    "Cannot allocate memory"). Programs needed again are read back from the on-disk cache.

    First, every program the module's tests left compiled is checked for a host round trip: a
    whole generate call is one prefill and one decode program on the device, so none of their
    instructions may call back into Python or move data to or from the host."""
    yield
    release_programs()


def release_programs():
    """Check every compiled program engine.PROGRAMS holds for a host round trip (as the module
    fixture above does), then drop them all and JAX's caches. Tests that drop programs midway
    (to compile again) call this instead of ``engine.PROGRAMS.clear()``, so no program leaves
    unchecked."""
    held = host_round_trips()
    engine.PROGRAMS.clear()
    jax.clear_caches()
    assert not held, f"compiled programs that call the host inside the loop: {held[:5]}"


# a host callback (jax.debug.callback, pure_callback, io_callback) or host transfer in HLO text
_HOST_WORDS = ("callback", "send", "recv", "infeed", "outfeed")  # in every _HOST_CALL match
_HOST_CALL = re.compile(r'custom_call_target="[^"]*callback[^"]*"|\b(?:send|recv|infeed|outfeed)'
                        r'(?:-done)?\(')


def host_round_trips() -> list[str]:
    """'plan stage: instruction' for each instruction of the compiled programs engine.PROGRAMS
    holds that calls the host (_HOST_CALL)."""
    found = []
    for program in engine.PROGRAMS.programs():
        for stage in ("prefill", "decode", "segment", "round"):
            for exe in program.executables(stage):
                text = exe.as_text()
                if not any(word in text for word in _HOST_WORDS):  # 8x faster than the regex
                    continue
                found += [f"{type(program.plan.proposer).__name__} {stage}: {m.group(0)}"
                          for m in _HOST_CALL.finditer(text)]
    return found


@pytest.fixture
def fresh_programs():
    """Forget every compiled program before and after a test that patches traced code (each
    checked for host round trips first: ``release_programs``)."""
    release_programs()
    yield
    release_programs()


def ref_process(logits, temperature=1.0, top_k=0, top_p=1.0):
    """Plain numpy reference of temperature -> top-k -> top-p, written independently of
    specjax.sampling: logits [..., V] -> probabilities [..., V] (float64)."""
    logits = np.asarray(logits, np.float64)
    if temperature > 0 and top_p >= 1.0:  # vectorised path, same rule
        x = logits / temperature
        if 0 < top_k < x.shape[-1]:
            kth = -np.sort(-x, axis=-1)[..., top_k - 1:top_k]
            x = np.where(x < kth, -np.inf, x)
        p = np.exp(x - x.max(-1, keepdims=True))
        return p / p.sum(-1, keepdims=True)
    out = np.empty_like(logits)
    for idx in np.ndindex(logits.shape[:-1]):
        x = logits[idx]
        if temperature == 0:
            p = np.zeros_like(x)
            p[int(np.argmax(x))] = 1.0
            out[idx] = p
            continue
        x = x / temperature
        if 0 < top_k < x.size:
            kth = np.sort(x)[::-1][top_k - 1]
            x = np.where(x < kth, -np.inf, x)
        p = np.exp(x - x.max())
        p /= p.sum()
        if top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            kept, mass = [], 0.0
            for i in order:  # smallest prefix whose mass reaches top_p
                if mass >= top_p:
                    break
                kept.append(i)
                mass += p[i]
            threshold = min(p[i] for i in kept)
            p = np.where(p >= threshold, p, 0.0)  # ties with the threshold stay
            p /= p.sum()
        out[idx] = p
    return out


def verification_paths(draft) -> dict:
    """{name: (SpecConfig or None, draft)}: one setting for each way a round is verified
    (autoregressive, a chain, n-gram's per-row lengths, a tree; lookahead's tree beside its
    window in one forward, suffix's tree of varied fill), for tests that must hold on every
    path."""
    return {"autoregressive": (None, None),
            "chain": (sj.SpecConfig(num_speculative_tokens=3), draft),
            # every match verified (no acceptance gate): the path, not the gate, is under test
            "ngram": (sj.SpecConfig(method="ngram", num_speculative_tokens=3,
                                    prompt_lookup_min=1, acceptance_floor=0), None),
            "tree": (sj.SpecConfig(tree=((0,), (1,), (0, 0), (0, 0, 0))), draft),
            "lookahead": (sj.SpecConfig(method="lookahead", num_speculative_tokens=3,
                                        lookahead_window=3, lookahead_candidates=2), None),
            "suffix": (sj.SpecConfig(method="suffix", tree=((0,), (1,), (0, 0), (0, 0, 0)),
                                     suffix_decoding_min_token_prob=0.0,
                                     acceptance_floor=0), None)}

