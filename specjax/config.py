"""Frozen configuration dataclasses.

Everything here is hashable: a config that fixes a shape (vocabulary, layer count, γ) is a static
argument of the compiled programs, so two calls with equal configs share one program. Values that
vary per call (temperature, top-k, top-p, max_new_tokens) are copied into arrays by the engine and
never cause a recompile.

Every constructor validates its fields and raises ``ValueError`` naming the bad value, so bad input
fails before anything is traced or compiled.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from typing import Any

_DTYPES = ("float32", "bfloat16", "float16")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(label: str, value: Any, minimum: int) -> None:
    """A ValueError "``label`` must be an int >= ``minimum``, got ..." unless ``value`` is an
    int (not a bool) that large."""
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{label} must be an int >= {minimum}, got {value!r}")


def _plain(value: Any) -> Any:
    """A 0-d array (``jnp.float32(0.5)``, ``np.array(3)``) as the Python number it holds; any
    other value as it is."""
    if getattr(value, "shape", None) == () and not isinstance(value, numbers.Number):
        try:
            return value.item()
        except (AttributeError, TypeError, ValueError):
            return value
    return value


def _require_int(owner: Any, name: str, value: Any, minimum: int,
                 maximum: int | None = None, bound: str | None = None) -> None:
    """Check an int field (numpy ints and 0-d integer arrays welcome) and store it back as a
    plain int. Above ``maximum`` it is refused as a corrupt model config, or, with ``bound`` (why
    the maximum is what it is), as a setting out of range."""
    value = _plain(value)
    check_int(f"{type(owner).__name__}.{name}", value, minimum)
    if maximum is not None and value > maximum and bound is not None:
        raise ValueError(f"{type(owner).__name__}.{name} must be at most {maximum:,} ({bound}), "
                         f"got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{type(owner).__name__}.{name}={value!r} is beyond any model this "
                         f"library can hold (at most {maximum:,}): a corrupt config?")
    object.__setattr__(owner, name, int(value))


# Bounds that no real model reaches, so a corrupt or hostile config.json is refused before it
# allocates anything: token ids are int32, and the largest models have hidden sizes near 2^14,
# a few hundred layers and contexts of millions of tokens.
LIMITS = {"vocab_size": 2**31 - 1, "hidden_size": 2**20, "intermediate_size": 2**22,
          "num_hidden_layers": 2**12, "num_attention_heads": 2**14,
          "num_key_value_heads": 2**14, "head_dim": 2**16,
          "max_position_embeddings": 2**28, "sliding_window": 2**28}
MAX_PARAMS = 10**13


def _positive(x: float) -> bool:
    return 0 < x < math.inf


def _require_real(owner: Any, name: str, value: Any, ok, allowed: str) -> None:
    """Check a float field (numpy floats and 0-d arrays welcome) and store it back as a plain
    float."""
    value = _plain(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(value):
        raise ValueError(f"{type(owner).__name__}.{name} must be {allowed}, got {value!r}")
    object.__setattr__(owner, name, float(value))


ROPE_TYPES = ("default", "linear", "llama3")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling, as in Hugging Face's ``rope_scaling`` / ``rope_parameters``."""

    rope_type: str = "default"  # "default" (none), "linear" (positions / factor) or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"RoPE scaling type {self.rope_type!r} is not supported; supported: "
                             f"{', '.join(ROPE_TYPES)}")
        for name in ("factor", "low_freq_factor"):
            _require_real(self, name, getattr(self, name), _positive, "a finite number > 0")
        _require_real(self, "high_freq_factor", self.high_freq_factor,
                      lambda x: self.low_freq_factor < x < math.inf,
                      "> low_freq_factor and finite")
        _require_int(self, "original_max_position_embeddings",
                     self.original_max_position_embeddings, 1)


BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "o_proj_bias", "qk_norm",
               "scale_embeddings", "norm_unit_offset", "sandwich_norms")
"""ModelConfig's switches: each True or False (numpy's bool too), nothing else."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-family decoder. Field names follow Hugging Face's ``config.json``."""

    vocab_size: int  # number of token ids; logits are [.., V]
    hidden_size: int  # model width E
    intermediate_size: int  # SwiGLU width F
    num_hidden_layers: int  # L
    num_attention_heads: int  # query heads H
    num_key_value_heads: int | None = None  # kv heads K (grouped-query attention); None = H
    head_dim: int | None = None  # D; None = hidden_size // num_attention_heads
    max_position_embeddings: int = 2048  # longest prompt + generation the model accepts
    rope_theta: float = 10000.0  # RoPE base frequency
    rms_norm_eps: float = 1e-6  # epsilon inside RMSNorm
    tie_word_embeddings: bool = False  # LM head reuses the input embedding matrix
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2; Llama's flag sets o too)
    o_proj_bias: bool = False  # bias on the attention output projection (Llama attention_bias)
    qk_norm: bool = False  # RMSNorm on each query and key head before RoPE (Qwen3)
    rope_scaling: RopeScaling | None = None  # None = plain RoPE
    sliding_window: int | None = None  # attend to at most this many latest positions (Mistral)
    dtype: str = "float32"  # parameter and activation dtype; norms, softmax and logits are float32
    # -- what other families change (defaults: Llama's); docs/checkpoints.md
    hidden_act: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) in the model dtype (Gemma)
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), in float32 (Gemma)
    sandwich_norms: bool = False  # also a norm after attention, before and after the MLP
    #   (Gemma 2, 3): post_attention_layernorm then normalises the attention's output
    query_pre_attn_scalar: float | None = None  # scores scaled by this ** -0.5; None: head_dim
    attn_logit_softcapping: float | None = None  # scores -> c * tanh(scores / c) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> c * tanh(logits / c) (Gemma 2)
    # per layer "full_attention" or "sliding_attention" (then sliding_window applies); None: every
    # layer slides when sliding_window is set (Mistral, Phi-3)
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # sliding layers' RoPE base, unscaled (Gemma 3); None:
    #   the same RoPE as the full layers

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "max_position_embeddings"):
            _require_int(self, name, getattr(self, name), 1, LIMITS[name])
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        _require_int(self, "num_key_value_heads", self.num_key_value_heads, 1,
                     LIMITS["num_key_value_heads"])
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"ModelConfig.hidden_size ({self.hidden_size}) is not divisible by "
                    f"num_attention_heads ({self.num_attention_heads}); set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        _require_int(self, "head_dim", self.head_dim, 2, LIMITS["head_dim"])
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps"):
            _require_real(self, name, getattr(self, name), _positive, "a finite number > 0")
        # a string ("false") or a number would switch a feature on by its truth value
        for name in BOOL_FIELDS:
            value = _plain(getattr(self, name))
            if not isinstance(value, bool) and type(value).__name__ != "bool_":
                raise ValueError(f"ModelConfig.{name} must be True or False, got {value!r}")
            object.__setattr__(self, name, bool(value))
        if self.sliding_window is not None:
            _require_int(self, "sliding_window", self.sliding_window, 1, LIMITS["sliding_window"])
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"ModelConfig.rope_scaling must be a RopeScaling or None, got "
                             f"{self.rope_scaling!r}")
        if not isinstance(self.dtype, str):  # a dtype object (np.dtype("float32")) by its name:
            # equal configs must hash alike (programs are cached by config) and write as JSON
            object.__setattr__(self, "dtype", getattr(self.dtype, "name", None)
                               or getattr(self.dtype, "__name__", self.dtype))
        if self.dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"ModelConfig.hidden_act must be one of {HIDDEN_ACTS}, got "
                             f"{self.hidden_act!r}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_theta"):
            if getattr(self, name) is not None:
                _require_real(self, name, getattr(self, name),
                              lambda x: 0 < x < math.inf, "a finite number > 0 or None")
        if self.layer_types is not None:
            kinds = self.layer_types
            if isinstance(kinds, str) or not isinstance(kinds, tuple | list) or len(kinds) != \
                    self.num_hidden_layers or any(k not in LAYER_TYPES for k in kinds):
                raise ValueError(f"ModelConfig.layer_types must list one of {LAYER_TYPES} for "
                                 f"each of the {self.num_hidden_layers} layers, got {kinds!r}")
            object.__setattr__(self, "layer_types", tuple(kinds))
            if "sliding_attention" in kinds and self.sliding_window is None:
                raise ValueError("ModelConfig.layer_types has sliding layers but sliding_window "
                                 "is None")
        if self.num_params > MAX_PARAMS:
            raise ValueError(f"ModelConfig describes {self.num_params:.3g} parameters (hidden_size "
                             f"{self.hidden_size}, intermediate_size {self.intermediate_size}, "
                             f"{self.num_hidden_layers} layers, vocab_size {self.vocab_size}), "
                             f"beyond any real model (at most {MAX_PARAMS:.0e}): a corrupt config?")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to everything before)."""
        if self.layer_types is not None and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    def layer_rope(self, layer: int) -> ModelConfig:
        """The config whose RoPE layer ``layer`` uses (Gemma 3's sliding layers have their own
        base and no scaling)."""
        if self.rope_local_theta is None or self.layer_window(layer) is None:
            return self
        return self.local_rope()

    def local_rope(self) -> ModelConfig:
        """The config of the sliding layers' RoPE: base ``rope_local_theta``, no scaling."""
        return dataclasses.replace(self, rope_theta=self.rope_local_theta, rope_scaling=None,
                                   rope_local_theta=None)

    def single_layer(self, **changes) -> ModelConfig:
        """This config with one layer (a drafter's layer shape): no per-layer kinds, no sliding
        window."""
        return dataclasses.replace(self, num_hidden_layers=1, sliding_window=None,
                                   layer_types=None, rope_local_theta=None, **changes)

    @property
    def num_params(self) -> int:
        """Parameter count, LM head included (once when tied)."""
        E, F, V, D = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        H, K = self.num_attention_heads, self.num_key_value_heads
        attn = E * D * (H + 2 * K) + H * D * E
        if self.attention_bias:
            attn += D * (H + 2 * K)
        if self.o_proj_bias:
            attn += E
        if self.qk_norm:
            attn += 2 * D
        layer = attn + 3 * E * F + (4 if self.sandwich_norms else 2) * E
        head = 0 if self.tie_word_embeddings else E * V
        return V * E + self.num_hidden_layers * layer + E + head


MAX_EOS_IDS = 8
"""EOS ids live in a fixed-size array, so changing them never recompiles."""

TOP_P_MIN = 2.0 ** -126
"""The smallest SamplingParams.top_p: float32's smallest normal number (below it a top_p
reaches the device as 0)."""

MAX_PROMPT_LOOKUP = 64
"""The longest n-gram SpecConfig.prompt_lookup_max may look up (each n is one pass over the
history in every round)."""

MAX_LOGPROBS = 20
"""The most alternatives ``SamplingParams.logprobs`` returns per token (vLLM's default too)."""

MAX_STOP_SEQUENCES = 8
MAX_STOP_LENGTH = 8
"""Stop token sequences live in a fixed [MAX_STOP_SEQUENCES, MAX_STOP_LENGTH] array, matched on
the device inside the loop, so changing them never recompiles."""

IDLE_ROUNDS = 16
"""SpecConfig.idle_rounds' default with a verify budget: the longest rest, in rounds."""
MAX_IDLE_ROUNDS = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How each token is drawn. Applied in the order temperature, top-k, top-p (as in HF/vLLM).

    The same processing serves the draft (q), the target (p), recovered and bonus tokens and the
    autoregressive baseline, so speculation never changes which distribution is sampled.
    """

    temperature: float = 1.0  # 0 = greedy (argmax through an explicit mask)
    top_k: int = 0  # keep the k most likely tokens; 0 (or vLLM's -1) = off
    top_p: float = 1.0  # keep the smallest set whose mass reaches top_p; 1.0 = off
    max_new_tokens: int = 64  # tokens generated per row, EOS included
    # a row stops after emitting any of these; None: the tokenizer's EOS ids when generate is
    # given tokenizer= (else none); () or []: none at all, the tokenizer's ignored too
    eos_token_id: int | tuple[int, ...] | None = None
    # token sequences that end a row once it has generated one (kept in the output, like EOS):
    # ids (one-token sequences, as vLLM's stop_token_ids) or lists of ids, matched on the device
    stop_token_ids: tuple[tuple[int, ...], ...] | None = None
    # strings that end a row once its text contains one (needs tokenizer=); the text is cut
    # before the string unless include_stop_str_in_output, the tokens after the one completing it
    stop: tuple[str, ...] | None = None
    include_stop_str_in_output: bool = False
    # return, for every emitted token, the target's log-probability of it and its `logprobs`
    # most likely alternatives (0: the token's alone; None: nothing), from the raw model
    # distribution ("raw", as vLLM's default logprobs_mode) or the processed one ("processed":
    # after temperature, top-k and top-p, what the token was drawn from)
    logprobs: int | None = None
    logprobs_mode: str = "raw"

    def __post_init__(self):
        _require_real(self, "temperature", self.temperature,
                      lambda x: x >= 0 and math.isfinite(x), "a finite number >= 0")
        if _is_int(_plain(self.top_k)) and _plain(self.top_k) == -1:  # vLLM's spelling of off
            object.__setattr__(self, "top_k", 0)
        if _is_int(_plain(self.top_k)) and _plain(self.top_k) < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0, or -1 (as 0: no top-k "
                             f"filter), got {self.top_k!r}")
        _require_int(self, "top_k", self.top_k, 0, 2 ** 31 - 1,
                     bound="token ids are int32")
        # below float32's smallest normal number a top_p reaches the device as 0 (every token
        # filtered out but the first)
        _require_real(self, "top_p", self.top_p, lambda x: TOP_P_MIN <= x <= 1,
                      f"in [{TOP_P_MIN:.1e}, 1] (float32's smallest normal number up)")
        _require_int(self, "max_new_tokens", self.max_new_tokens, 1)
        eos = _plain(self.eos_token_id)
        if eos is not None:
            try:
                ids = (eos,) if _is_int(eos) else tuple(_plain(i) for i in eos)
            except TypeError:
                ids = (eos,)
            if not all(_is_int(i) and i >= 0 for i in ids):
                raise ValueError(f"SamplingParams.eos_token_id must be an int >= 0 or a list of "
                                 f"them, got {eos!r}")
            if len(ids) > MAX_EOS_IDS:
                raise ValueError(f"SamplingParams.eos_token_id has {len(ids)} ids; at most "
                                 f"{MAX_EOS_IDS} are supported")
            # () (an empty list) stays: no EOS at all, not even a tokenizer's (vLLM's ignore_eos)
            object.__setattr__(self, "eos_token_id", tuple(int(i) for i in ids))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", _stop_sequences(self.stop_token_ids))
        if self.stop is not None:
            stop = (self.stop,) if isinstance(self.stop, str) else self.stop
            # a list or tuple of strings (a dict or a set has no order, or holds other things)
            stop = tuple(stop) if isinstance(stop, (list, tuple)) else None
            if stop is None or not all(isinstance(x, str) and x for x in stop):
                raise ValueError(f"SamplingParams.stop must be a non-empty string or a list of "
                                 f"them, got {self.stop!r}")
            object.__setattr__(self, "stop", stop or None)
        if self.logprobs is not None:
            _require_int(self, "logprobs", self.logprobs, 0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"SamplingParams.logprobs must be an int in [0, "
                                 f"{MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"SamplingParams.logprobs_mode must be 'raw' or 'processed', got "
                             f"{self.logprobs_mode!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"SamplingParams.include_stop_str_in_output must be a bool, got "
                             f"{self.include_stop_str_in_output!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.eos_token_id or ()


def _stop_sequences(value) -> tuple[tuple[int, ...], ...] | None:
    """stop_token_ids checked: ids or lists of ids -> a tuple of non-empty id tuples."""
    bad = ValueError(f"SamplingParams.stop_token_ids must be a list of token ids (each a "
                     f"one-token stop sequence) or of lists of them, at most "
                     f"{MAX_STOP_SEQUENCES} sequences of 1 to {MAX_STOP_LENGTH} ids >= 0, got "
                     f"{value!r}")
    if _is_int(value) or isinstance(value, (str, bytes)):
        raise bad
    try:
        items = list(value)
        items = [_plain(x) for x in items]
        sequences = tuple((int(x),) if _is_int(x) else tuple(_plain(i) for i in x)
                          for x in items)
    except TypeError:
        raise bad from None
    if len(sequences) > MAX_STOP_SEQUENCES or not all(
            1 <= len(s) <= MAX_STOP_LENGTH and all(_is_int(i) and i >= 0 for i in s)
            for s in sequences):
        raise bad
    return tuple(tuple(int(i) for i in s) for s in sequences) or None


def _method(name: str):
    """The registered draft method ``name`` (specjax/draft/registry.py); ValueError if unknown."""
    from .draft import registry  # the package registers the built-in methods on import
    try:
        return registry.get(name)
    except ValueError:
        raise ValueError(f"SpecConfig.method {name!r} is unknown; known methods: "
                         f"{', '.join(registry.names())}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """Speculative decoding settings, in vLLM's ``--speculative-config`` vocabulary."""

    method: str = "draft_model"  # which proposer makes the drafts (specjax.draft.names())
    # γ: drafts per round (the target verifies γ + 1 positions). None: 4 for a chain, the number
    # of tree nodes with a tree (given with a tree, it must equal that number, as in vLLM).
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int = 2  # ngram: shortest suffix looked up in the row's own text
    prompt_lookup_max: int = 4  # ngram: longest suffix looked up (tried first)
    # ngram: a match of n tokens proposes at most ceil(factor × n) of the γ (None: up to γ)
    prompt_lookup_length_factor: float | None = None
    # A static draft tree in vLLM's speculative_token_tree format: one path of child ranks per
    # node, e.g. ((0,), (1,), (0, 0)); see specjax/tree.py. None = a chain of γ drafts.
    tree: tuple[tuple[int, ...], ...] | None = None
    # BENCHMARK ONLY, NOT LOSSLESS (as vLLM's synthetic rejection mode): draft position i is
    # accepted with probability α_i whatever the draft and the target say, so random weights
    # run rounds of a realistic length. A float: the same α at every position; a tuple: one per
    # position (γ of them). Chains only. ``generate`` refuses it unless allow_synthetic=True.
    synthetic_acceptance: float | tuple[float, ...] | None = None
    # Adaptive draft lengths (specjax/adaptive.py): the batch verifies draft k, in every row still
    # generating, while some row's calibrated chance that its drafts 1 .. k all survive is at
    # least this; drafting stops once no row wants more. None: every row proposes γ. Chains of
    # methods that support it.
    survival_threshold: float | None = None
    # The batch's verify budget (specjax/adaptive.py, Budget): what a target forward over 1, 2,
    # ..., γ + 1 tokens costs at the batch size you run, in one-token steps (from
    # sj.adaptive.measure_costs or the roofline report), and one draft step's cost. The batch
    # then verifies only the draft positions whose predicted survival pays for the wider
    # forward, down to none at all. With or without survival_threshold; same methods.
    verify_costs: tuple[float, ...] | None = None
    draft_cost: float | None = None  # None: 0 (with verify_costs)
    # what a round that drafts costs besides its forwards and drafts (verification,
    # bookkeeping), beyond a plain decode step's own, in one-token steps; it makes wider rounds
    # relatively cheaper, and a round without drafts does not pay it. None: 0 (with
    # verify_costs)
    round_cost: float | None = None
    # what a round that verifies no draft costs (its decode step and the draft step that scored
    # draft 1), in one-token steps; None: 1 + draft_cost (with verify_costs)
    decline_cost: float | None = None
    # Rests (engine.Idle), method draft_model with adaptive lengths: after two proposals in a row
    # in which no row drafted, the next rounds skip the draft altogether (1, 2, 4, ... up to this
    # many while the declines go on), then the draft reads what it missed in a few wide forwards.
    # Under a load where drafting does not pay, decoding then runs at nearly a plain decode
    # step's cost. None: 16 with verify_costs, else 0; 0: never rest.
    idle_rounds: int | None = None
    # ngram and suffix (specjax/draft/gate.py): a row proposes only while its running rate of
    # proposing rounds whose first draft was accepted (past rounds only) is at least this. None:
    # gate.ACCEPTANCE_FLOOR (0.2); 0: always propose.
    acceptance_floor: float | None = None
    # suffix decoding (specjax/draft/suffix.py), in vLLM's names: the longest suffix matched;
    # a match of n tokens drafts at most ceil(factor × n) deep; a tree node's least share of its
    # parent's occurrences. Without a tree, num_speculative_tokens is the draft tree's depth.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # suffix decoding: the shortest match that drafts anything (ours, not vLLM's; 2 drafts less
    # at T = 1 without repetition, and accepts less where text repeats)
    suffix_decoding_min_match_length: int = 1
    # suffix decoding: the spec factor where the longest match lies in the row's own text (ours,
    # not vLLM's: a row that copies from its prompt or its own output tends to go on copying,
    # while a match found only in other requests' outputs keeps suffix_decoding_max_spec_factor;
    # docs/suffix.md has the measurements). None: suffix_decoding_max_spec_factor everywhere.
    suffix_decoding_own_spec_factor: float | None = 4.0
    # lookahead decoding (specjax/draft/lookahead.py): W, the Jacobi window's columns; G, the
    # candidate chains verified a round (without a tree); n-grams kept per row. Its n-grams are
    # num_speculative_tokens + 1 long (the tree's depth + 1 with a tree).
    lookahead_window: int = 1
    lookahead_candidates: int = 1
    lookahead_pool_size: int = 64

    def __post_init__(self):
        method = _method(self.method)
        if self.tree is not None:
            from .tree import Tree
            tree = Tree(self.tree)  # validates; raises ValueError naming the bad path
            object.__setattr__(self, "tree", tree.paths)
            if self.num_speculative_tokens is None:
                object.__setattr__(self, "num_speculative_tokens", len(tree.paths))
            elif self.num_speculative_tokens != len(tree.paths):
                raise ValueError(f"SpecConfig.num_speculative_tokens="
                                 f"{self.num_speculative_tokens!r}"
                                 f" but the tree has {len(tree.paths)} nodes: they must agree "
                                 f"(or leave num_speculative_tokens out)")
            if not method.tree:
                from .draft import registry
                tree_methods = [n for n in registry.names() if registry.get(n).tree]
                raise ValueError(f"SpecConfig.tree is not supported with method "
                                 f"{self.method!r}; tree methods: {', '.join(tree_methods)}")
        elif self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", 4)
        from .tree import MAX_DEPTH, MAX_NODES
        _require_int(self, "num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.num_speculative_tokens > MAX_NODES:
            raise ValueError(f"SpecConfig.num_speculative_tokens={self.num_speculative_tokens}; "
                             f"at most {MAX_NODES} drafts a round are supported")
        if (self.method in ("suffix", "lookahead") and self.tree is None
                and self.num_speculative_tokens > MAX_DEPTH):
            raise ValueError(f"SpecConfig.num_speculative_tokens={self.num_speculative_tokens}; "
                             f"method {self.method!r} drafts a tree that deep, and trees of at "
                             f"most {MAX_DEPTH} levels are supported")
        _require_int(self, "prompt_lookup_min", self.prompt_lookup_min, 1)
        _require_int(self, "prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min,
                     MAX_PROMPT_LOOKUP, bound="each n is a pass over the history every round")
        factor = self.prompt_lookup_length_factor
        if factor is not None:
            _require_real(self, "prompt_lookup_length_factor", factor,
                          lambda x: math.isfinite(x) and x > 0, "a finite number > 0 or None")
        if self.acceptance_floor is not None:
            _require_real(self, "acceptance_floor", self.acceptance_floor,
                          lambda x: 0 <= x <= 1, "in [0, 1] or None")
            if self.method not in ("ngram", "suffix"):
                raise ValueError(f"SpecConfig.acceptance_floor is for methods 'ngram' and "
                                 f"'suffix', not {self.method!r}")
        _require_int(self, "suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth,
                     1, 31)
        _require_int(self, "suffix_decoding_min_match_length",
                     self.suffix_decoding_min_match_length, 1)
        if self.suffix_decoding_min_match_length > self.suffix_decoding_max_tree_depth:
            raise ValueError(f"SpecConfig.suffix_decoding_min_match_length="
                             f"{self.suffix_decoding_min_match_length} is longer than the longest "
                             f"match looked for (suffix_decoding_max_tree_depth="
                             f"{self.suffix_decoding_max_tree_depth})")
        _require_real(self, "suffix_decoding_max_spec_factor",
                      self.suffix_decoding_max_spec_factor,
                      lambda x: math.isfinite(x) and x > 0, "a finite number > 0")
        if self.suffix_decoding_own_spec_factor is not None:
            _require_real(self, "suffix_decoding_own_spec_factor",
                          self.suffix_decoding_own_spec_factor,
                          lambda x: math.isfinite(x) and x > 0, "a finite number > 0 or None")
        _require_real(self, "suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob,
                      lambda x: 0 <= x <= 1, "in [0, 1]")
        for name, most in [("lookahead_window", 32), ("lookahead_candidates", 16),
                           ("lookahead_pool_size", 4096)]:
            _require_int(self, name, getattr(self, name), 1)
            if getattr(self, name) > most:
                raise ValueError(f"SpecConfig.{name} must be at most {most}, got "
                                 f"{getattr(self, name)!r}")
        # options of one method given to another: refused (a typo of the method would run
        # another method without a word)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for prefix, owner in (("suffix_decoding_", "suffix"), ("lookahead_", "lookahead"),
                              ("prompt_lookup_", "ngram")):
            changed = [n for n in defaults if n.startswith(prefix)
                       and getattr(self, n) != defaults[n]]
            if changed and self.method != owner:
                raise ValueError(f"SpecConfig.{changed[0]}={getattr(self, changed[0])!r} is an "
                                 f"option of method {owner!r}, not {self.method!r}")
        if self.method in ("suffix", "lookahead") and self.tree is not None:
            from .draft.base import MAX_CANDIDATES, check_fanout
            from .tree import Tree
            pool = self.lookahead_pool_size if self.method == "lookahead" else MAX_CANDIDATES
            check_fanout(Tree(self.tree), min(MAX_CANDIDATES, pool),
                         f"SpecConfig.tree with method {self.method!r}"
                         + (f" and lookahead_pool_size={pool}" if pool < MAX_CANDIDATES else ""))
            if self.method == "lookahead" and self.lookahead_candidates != 1:
                raise ValueError(f"SpecConfig.lookahead_candidates={self.lookahead_candidates} "
                                 f"sets the chains of a lookahead round without a tree; with "
                                 f"tree= the tree is the shape: leave it out")
        if self.method == "lookahead" and self.lookahead_pool_size < max(
                self.lookahead_window, 1 if self.tree is not None else self.lookahead_candidates):
            raise ValueError(f"SpecConfig.lookahead_pool_size={self.lookahead_pool_size} is "
                             f"smaller than the n-grams a round adds (lookahead_window="
                             f"{self.lookahead_window}) or the chains it verifies "
                             f"(lookahead_candidates={self.lookahead_candidates})")
        if self.method == "lookahead" and self.tree is None:
            from .tree import MAX_NODES
            nodes = self.lookahead_candidates * self.num_speculative_tokens
            if nodes > MAX_NODES:
                raise ValueError(f"lookahead verifies lookahead_candidates × "
                                 f"num_speculative_tokens = {self.lookahead_candidates} × "
                                 f"{self.num_speculative_tokens} = {nodes} nodes a round; at most "
                                 f"{MAX_NODES} are supported")
        if self.synthetic_acceptance is not None:
            object.__setattr__(self, "synthetic_acceptance", self._synthetic_profile())
        if self.survival_threshold is not None:
            _require_real(self, "survival_threshold", self.survival_threshold,
                          lambda x: 0 < x < 1, "in (0, 1) or None")
        for name in ("draft_cost", "round_cost", "decline_cost"):
            if getattr(self, name) is not None and self.verify_costs is None:
                raise ValueError(f"SpecConfig.{name}={getattr(self, name)!r} needs "
                                 f"verify_costs (the verify budget)")
        if self.verify_costs is not None:
            from .adaptive import Budget
            Budget.of(self.verify_costs, 0.0 if self.draft_cost is None else self.draft_cost,
                      self.num_speculative_tokens,
                      0.0 if self.round_cost is None else self.round_cost,
                      decline_cost=self.decline_cost)  # checks them
            object.__setattr__(self, "verify_costs", tuple(self.verify_costs))
        if self.idle_rounds is not None:
            if not _is_int(self.idle_rounds) or not 0 <= self.idle_rounds <= MAX_IDLE_ROUNDS:
                raise ValueError(f"SpecConfig.idle_rounds must be an int in [0, "
                                 f"{MAX_IDLE_ROUNDS}] or None, got {self.idle_rounds!r}")
            if self.idle_rounds and (self.method != "draft_model" or (
                    self.survival_threshold is None and self.verify_costs is None)):
                raise ValueError(f"SpecConfig.idle_rounds={self.idle_rounds} rests the draft of "
                                 f"method 'draft_model' with adaptive lengths (survival_threshold "
                                 f"or verify_costs); got method {self.method!r}"
                                 + ("" if self.survival_threshold is not None
                                    or self.verify_costs is not None
                                    else " without them"))
        for name in ("survival_threshold", "verify_costs"):
            if getattr(self, name) is not None and (self.tree is not None or not method.adaptive):
                from .draft import registry
                adaptive = [n for n in registry.names() if registry.get(n).adaptive]
                raise ValueError(f"SpecConfig.{name} (adaptive draft lengths) is for "
                                 f"chains of method {', '.join(adaptive)}; got method "
                                 f"{self.method!r}" + (" with a tree" if self.tree else ""))

    @property
    def floor(self) -> float:
        """The acceptance floor ngram and suffix rows propose above (0: no gate)."""
        from .draft.gate import ACCEPTANCE_FLOOR
        return ACCEPTANCE_FLOOR if self.acceptance_floor is None else float(self.acceptance_floor)

    @property
    def rests(self) -> int:
        """The longest rest (``idle_rounds`` with its default): 0 where rounds never rest."""
        if self.idle_rounds is not None:
            return int(self.idle_rounds)
        return IDLE_ROUNDS if self.verify_costs is not None and self.method == "draft_model" \
            and self.tree is None else 0

    @property
    def budget(self):
        """The verify budget (``adaptive.Budget``, costs divided by the first), or None."""
        if self.verify_costs is None:
            return None
        from .adaptive import SEQUENTIAL_DRAFTERS, Budget
        return Budget.of(self.verify_costs, self.draft_cost or 0.0,
                         round_cost=self.round_cost or 0.0,
                         sequential=self.method in SEQUENTIAL_DRAFTERS,
                         decline_cost=self.decline_cost)

    def _synthetic_profile(self) -> tuple[float, ...]:
        """synthetic_acceptance as one α per draft position, checked."""
        alpha, gamma = self.synthetic_acceptance, self.num_speculative_tokens
        if self.tree is not None:
            raise ValueError("SpecConfig.synthetic_acceptance is for chains, not trees")
        single = isinstance(alpha, numbers.Real) and not isinstance(alpha, bool)
        profile = (alpha,) * gamma if single else alpha
        if (not isinstance(profile, (tuple, list)) or len(profile) != gamma
                or not all(isinstance(a, numbers.Real) and not isinstance(a, bool)
                           and 0 <= a <= 1 for a in profile)):
            raise ValueError(f"SpecConfig.synthetic_acceptance must be a probability in [0, 1] "
                             f"or {gamma} of them (one per draft position), got {alpha!r}")
        return tuple(float(a) for a in profile)

    @property
    def needs_draft_model(self) -> bool:
        """Whether draft= must be a draft model (sj.Model or sj.DraftModel)."""
        return _method(self.method).draft == "model"

    @property
    def needs_heads(self) -> bool:
        """Whether draft= must be Medusa or EAGLE heads (sj.Heads)."""
        return _method(self.method).draft == "heads"

    @property
    def needs_drafter(self) -> bool:
        """Deprecated: ``needs_heads``."""
        import warnings
        warnings.warn("SpecConfig.needs_drafter is renamed needs_heads", DeprecationWarning,
                      stacklevel=2)
        return self.needs_heads

    @classmethod
    def parse(cls, spec: SpecConfig | Mapping[str, Any] | str | None) -> SpecConfig | None:
        """Accept a SpecConfig, a dict, a JSON string (vLLM style), a method's bare name
        ("ngram": that method's defaults), or None (no speculation)."""
        if spec is None or isinstance(spec, SpecConfig):
            return spec
        if isinstance(spec, str):
            from .draft import registry
            if spec.strip() in registry.names():  # a method's bare name: its defaults
                return cls(method=spec.strip())
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON nor a method name "
                                 f"({', '.join(registry.names())}): {spec!r} ({e})") from None
        if not isinstance(spec, Mapping):
            raise ValueError(f"spec must be a SpecConfig, dict, JSON string or None, got {spec!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known)
        if "model" in unknown:  # vLLM's key for the draft's path; the command line reads it
            raise ValueError(f"speculative config key 'model' ({spec['model']!r}) names a draft "
                             f"to load: in Python pass it loaded, draft=sj.load_draft_model(path) "
                             f"(heads: sj.load_heads(path, target))")
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        return cls(**spec)


_OLD_TABLES = {"METHODS": lambda m: True, "NEEDS_DRAFT_MODEL": lambda m: m.draft == "model",
               "NEEDS_DRAFTER": lambda m: m.draft == "heads", "TREE_METHODS": lambda m: m.tree}


def __getattr__(name):
    """The method tables this module used to hold, for one version: the registry has them now."""
    if name in _OLD_TABLES:
        import warnings

        from .draft import registry
        warnings.warn(f"specjax.config.{name} is gone: ask the registry (sj.draft.names(), "
                      f"sj.draft.get(name).draft / .tree)", DeprecationWarning, stacklevel=2)
        return tuple(n for n in registry.names() if _OLD_TABLES[name](registry.get(n)))
    raise AttributeError(f"module 'specjax.config' has no attribute {name!r}")
