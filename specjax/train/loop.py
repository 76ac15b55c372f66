"""The training loop: optax AdamW with warm-up and cosine decay, orbax checkpoints, exact resume.

A run lives in a work directory. Every ``checkpoint_every`` steps the full state (parameters,
optimizer state, step) is saved there with orbax; ``train`` on the same directory resumes from
the latest checkpoint. Batches are a pure function of (seed, step), so a resumed run continues
with exactly the state and data an uninterrupted one would have had.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..config import ModelConfig, _positive, _require_int, _require_real, check_int
from ..files import write_atomic
from ..model import Model, init_model, prefill
from ..stats import POSITION_EDGES
from .data import sample_batch

log = logging.getLogger(__name__)


def configure_logging(verbose: bool = False) -> None:
    """The training commands' logging: specjax's progress at INFO; other libraries (orbax, absl)
    at WARNING unless ``verbose``."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(message)s")
    logging.getLogger("specjax").setLevel(logging.INFO)
    for name in ("absl", "orbax", "jax"):
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int  # total optimizer steps of the run (the schedule's length)
    batch_size: int = 16
    seq_len: int = 256
    learning_rate: float = 1e-3  # peak, after warm-up
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # the cosine decays to this fraction of the peak
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 100
    eval_every: int = 250  # held-out loss every this many steps (and at the end)
    eval_batches: int = 8
    distill_temperature: float = 1.0  # for distillation: KL at this temperature
    distill_ce_weight: float = 0.0  # for distillation: weight of the plain next-token loss

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "checkpoint_every", "eval_every",
                     "eval_batches"):
            _require_int(self, name, getattr(self, name), 1)
        _require_int(self, "warmup_steps", self.warmup_steps, 0)
        _require_int(self, "seed", self.seed, 0)
        # a clip of 0 never learns; a negative one flips the gradient (trains uphill)
        for name in ("learning_rate", "grad_clip", "distill_temperature"):
            _require_real(self, name, getattr(self, name), _positive, "a finite number > 0")
        for name in ("weight_decay", "distill_ce_weight"):
            _require_real(self, name, getattr(self, name),
                          lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
        _require_real(self, "min_lr_ratio", self.min_lr_ratio, lambda v: 0 <= v <= 1,
                      "in [0, 1]")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array  # [] int32


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    warmup = min(cfg.warmup_steps, cfg.steps - 1)  # a short run still gets a decay phase
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, warmup, max(cfg.steps, warmup + 1),
        cfg.learning_rate * cfg.min_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                                   mask=_decayed))


def _decayed(params):
    """Weight decay on matrices only (kernels, embeddings); never on norm weights or biases."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) in ("kernel", "embedding"), params)


def _logits(config: ModelConfig, params, tokens: jax.Array) -> jax.Array:
    logits, _, _ = prefill(Model(config, params), tokens)
    return logits


def lm_loss(config: ModelConfig, params, batch: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy; batch [B, T+1]."""
    logits = _logits(config, params, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def distill_loss(config: ModelConfig, params, batch: jax.Array, teacher: Model,
                 temperature: float = 1.0, ce_weight: float = 0.0) -> jax.Array:
    """KL(teacher || student) over every position (the student learns the teacher's whole
    next-token distribution, not just its samples), plus ce_weight × the next-token loss."""
    inputs = batch[:, :-1]
    t_logits = jax.lax.stop_gradient(_logits(teacher.config, teacher.params, inputs))
    s_logits = _logits(config, params, inputs)
    t_logp = jax.nn.log_softmax(t_logits / temperature, axis=-1)
    s_logp = jax.nn.log_softmax(s_logits / temperature, axis=-1)
    kl = jnp.sum(jnp.exp(t_logp) * (t_logp - s_logp), axis=-1).mean() * temperature ** 2
    if ce_weight:
        kl = kl + ce_weight * optax.softmax_cross_entropy_with_integer_labels(
            s_logits, batch[:, 1:]).mean()
    return kl


@dataclasses.dataclass(frozen=True)
class LMObjective:
    """Next-token loss of a model; aux is unused."""

    config: ModelConfig

    def __call__(self, params, batch: jax.Array, aux) -> jax.Array:
        return lm_loss(self.config, params, batch)


@dataclasses.dataclass(frozen=True)
class DistillObjective:
    """distill_loss against a teacher whose params come in as aux."""

    config: ModelConfig
    teacher: ModelConfig
    temperature: float = 1.0
    ce_weight: float = 0.0

    def __call__(self, params, batch: jax.Array, aux) -> jax.Array:
        return distill_loss(self.config, params, batch, Model(self.teacher, aux),
                            self.temperature, self.ce_weight)


@dataclasses.dataclass(frozen=True)
class MixedDistillObjective:
    """DistillObjective over a batch of several parts of different lengths (a tuple of
    [B_i, T_i + 1] arrays), each part's mean weighted by its predicted tokens."""

    config: ModelConfig
    teacher: ModelConfig
    temperature: float = 1.0
    ce_weight: float = 0.0

    def __call__(self, params, batch: tuple, aux) -> jax.Array:
        teacher = Model(self.teacher, aux)
        sizes = [part.shape[0] * (part.shape[1] - 1) for part in batch]
        losses = [distill_loss(self.config, params, part, teacher, self.temperature,
                               self.ce_weight) for part in batch]
        return sum(n * loss for n, loss in zip(sizes, losses)) / sum(sizes)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _step(objective, cfg: TrainConfig, state: TrainState, batch: jax.Array, aux):
    """One optimizer step. objective(params, batch, aux) -> loss is hashable (a frozen
    dataclass), so it is part of the compile key; aux (a teacher's params, say) is an argument."""
    loss, grads = jax.value_and_grad(objective)(state.params, batch, aux)
    updates, opt_state = optimizer(cfg).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return TrainState(params, opt_state, state.step + 1), loss


_eval_loss = jax.jit(lm_loss, static_argnums=0)


def evaluate(model: Model, tokens: np.ndarray, batches: int = 8, batch_size: int = 16,
             seq_len: int = 256, seed: int = 12345) -> float:
    """Mean next-token loss (nats/token) on fixed random windows of a held-out stream."""
    losses = [float(_eval_loss(model.config, model.params,
                               sample_batch(tokens, batch_size, seq_len, seed, i)))
              for i in range(batches)]
    return float(np.mean(losses))


POSITION_BINS = tuple(zip((0,) + POSITION_EDGES[:-1], POSITION_EDGES))
"""The context-position bins of ``loss_by_position`` (those inside the model's context): the
bench's acceptance bins (``stats.POSITION_EDGES``) up to the last edge."""


@jax.jit
def _position_losses(model: Model, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] -> the loss of predicting each next token, [B, T - 1] (float32)."""
    logits = prefill(model, tokens)[0][:, :-1]
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]


def loss_by_position(model: Model, tokens: np.ndarray, batch_size: int = 4,
                     windows: int | None = None) -> dict[str, float]:
    """Mean next-token loss (nats/token) per ``POSITION_BINS`` bin of position within windows
    as long as the model's context (at most 1,024), cut one after another from a held-out
    stream (the first ``windows`` of them; None: all): whether quality holds past the lengths
    it was trained on. Keys "0-256", ... (a bin the context cuts ends there); "windows": how
    many were read."""
    check_int("batch_size", batch_size, 1)
    if windows is not None:
        check_int("windows", windows, 1)
    length = min(model.config.max_position_embeddings, POSITION_BINS[-1][1], len(tokens))
    cut = np.asarray(tokens[:len(tokens) // length * length]).reshape(-1, length)
    cut = cut[:windows].astype(np.int32)
    if not len(cut):
        raise ValueError(f"the held-out stream ({len(tokens)} tokens) is shorter than a window "
                         f"of {length}")
    sums = np.zeros(length - 1)
    for i in range(0, len(cut), batch_size):
        sums += np.asarray(_position_losses(model, jnp.asarray(cut[i:i + batch_size])),
                           np.float64).sum(0)
    count = len(cut)
    per_position = sums / count  # at position t: the loss of predicting token t + 1
    return {"windows": count, **{f"{lo}-{min(hi, length)}": float(per_position[lo:hi].mean())
                                 for lo, hi in POSITION_BINS if lo < length - 1}}


def _check_run(workdir: pathlib.Path, run: dict, resuming: bool = True) -> None:
    """Record the run's settings in workdir/run.json; refuse to resume with other settings.
    ``resuming`` False (the folder holds no checkpoint: a run that failed before its first,
    say on a seq_len longer than its data) records the new settings over the old."""
    run = json.loads(json.dumps(run))
    path = workdir / "run.json"
    if path.exists() and resuming:
        old = json.loads(path.read_text())
        changed = _differences(old, run)
        if changed:
            raise ValueError(f"{workdir} holds a run with other settings ({', '.join(changed)}"
                             f"); use a new work directory or the same settings")
    else:
        write_atomic(path, json.dumps(run, indent=1) + "\n")  # never half-written


_MISSING = object()

# What a run record holds that records written before specjax recorded it lack: a run begun
# then resumes without that check (it recorded nothing to check against).
RECORDED_LATER = frozenset({"data", "teacher_weights"})


def digest(*arrays) -> str:
    """A short SHA-256 of arrays (dtype, shape and contents; None for a missing one): what a run
    record keeps of the data it trains on, so a resume on other data is refused."""
    import hashlib
    h = hashlib.sha256()
    for a in arrays:
        if a is None:
            h.update(b"none")
            continue
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def eval_log(path: pathlib.Path) -> Callable[[int, float], None]:
    """An ``on_eval`` that appends each held-out evaluation to a JSON-lines file, so a run
    continued over several sessions keeps every session's (``read_evals``)."""
    def on_eval(step: int, loss: float) -> None:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "heldout_loss": loss}) + "\n")
    return on_eval


def read_evals(path: pathlib.Path) -> list[dict]:
    """The evaluations ``eval_log`` wrote, by step (one a step: the last written; a line a crash
    cut short is skipped)."""
    by_step = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            by_step[int(e["step"])] = e
    return [by_step[s] for s in sorted(by_step)]


def teacher_record(teacher: Model) -> dict:
    """The teacher's config and a fingerprint of its weights (``heads.fingerprint``, the same in
    any dtype): a draft resumed against a teacher trained further, or another one, is refused."""
    from ..draft.heads import fingerprint
    return {"teacher": dataclasses.asdict(teacher.config),
            "teacher_weights": fingerprint(teacher)}


def _added_defaults() -> dict:
    """The defaults of the config fields a run record holds, by field name: a field that a
    newer specjax added (absent from an older run's record) at its default is the behaviour the
    run was trained with."""
    from ..draft.heads import HeadsConfig
    out = {}
    for cls in (ModelConfig, HeadsConfig, TrainConfig):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out.setdefault(f.name, json.loads(json.dumps(f.default)))
    return out


def _differences(old, new, prefix: str = "") -> list[str]:
    """Dotted names of the settings that differ between two run records (a setting the old
    record lacks counts as the same when the new one holds that field's default)."""
    if isinstance(old, dict) and isinstance(new, dict):
        defaults = _added_defaults()
        return [name for k in sorted(set(old) | set(new))
                if k in old or (k not in RECORDED_LATER and new[k] != defaults.get(k, _MISSING))
                for name in _differences(old.get(k), new.get(k), f"{prefix}{k}.")]
    return [] if old == new else [prefix.rstrip(".")]


def _manager(workdir: pathlib.Path):
    import orbax.checkpoint as ocp
    return ocp, ocp.CheckpointManager(
        workdir.resolve() / "checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))


def train(config: ModelConfig, tokens: np.ndarray, cfg: TrainConfig, workdir, *,
          heldout: np.ndarray | None = None, teacher: Model | None = None,
          init: Model | None = None, progress: bool = True,
          on_eval: Callable[[int, float], None] | None = None,
          max_seconds: float | None = None) -> tuple[Model, list[dict]]:
    """Train (or distil, when teacher is given) a model on a token stream, resuming from the
    latest checkpoint in workdir. Stops after cfg.steps steps or max_seconds (checkpointing
    first). Returns the model and the held-out evaluations [{"step", "heldout_loss"}]."""
    if cfg.seq_len > config.max_position_embeddings:
        raise ValueError(f"TrainConfig.seq_len={cfg.seq_len} is longer than the model's context "
                         f"(max_position_embeddings={config.max_position_embeddings})")
    for name, stream in (("token stream", tokens), ("held-out stream", heldout)):
        if stream is not None:
            check_stream(name, stream, config.vocab_size, cfg.seq_len)
    if teacher is None:
        objective, aux = LMObjective(config), None
    else:
        objective = DistillObjective(config, teacher.config, cfg.distill_temperature,
                                     cfg.distill_ce_weight)
        aux = teacher.params
    run = {"model": dataclasses.asdict(config), "train": dataclasses.asdict(cfg),
           **({"teacher": None} if teacher is None else teacher_record(teacher)),
           "data": digest(tokens)}
    evaluate_fn = None
    if heldout is not None:
        def evaluate_fn(params):
            return evaluate(Model(config, params), heldout, cfg.eval_batches, cfg.batch_size,
                            cfg.seq_len)
    params = (init or init_model(config, jax.random.key(cfg.seed))).params
    params, history = fit(objective, params, aux, tokens, cfg, workdir, run,
                          evaluate_fn=evaluate_fn, progress=progress, on_eval=on_eval,
                          max_seconds=max_seconds)
    return Model(config, params), history


def check_stream(name: str, stream: np.ndarray, vocab_size: int, seq_len: int) -> None:
    """A training or held-out token stream, before anything is written or compiled: long
    enough for a window of seq_len + 1 tokens (sample_batch draws starts below len - seq_len
    - 1), and every id a token of the model (an id past the vocabulary trained every
    parameter to NaN without an error: the embedding lookup reads NaN for it)."""
    stream = np.asarray(stream)
    if stream.ndim != 1 or not np.issubdtype(stream.dtype, np.integer):
        raise ValueError(f"the {name} must be a 1-d array of integer token ids, got "
                         f"{stream.dtype}{list(stream.shape)}")
    if len(stream) < seq_len + 2:
        raise ValueError(f"the {name} of {len(stream)} tokens is shorter than seq_len + 2 = "
                         f"{seq_len + 2}")
    low, high = int(stream.min()), int(stream.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"the {name} holds token ids {low}..{high}, outside the model's "
                         f"vocabulary [0, {vocab_size}): encoded with another tokenizer?")


def fit(objective, params, aux, tokens: np.ndarray, cfg: TrainConfig, workdir, run: dict, *,
        evaluate_fn: Callable[[Any], float] | None = None, progress: bool = True,
        on_eval: Callable[[int, float], None] | None = None,
        max_seconds: float | None = None,
        batches: Callable[[int], Any] | None = None) -> tuple[Any, list[dict]]:
    """The loop under every training run: minimise objective(params, batch, aux) over batches of
    ``tokens`` (or ``batches(step)``, a pure function of the step, so a resumed run sees the
    batches it would have seen; ``tokens`` is then unused), resuming from the latest checkpoint
    in workdir (whose run.json must match ``run``). evaluate_fn(params) -> held-out loss, every
    cfg.eval_every steps and at the end. Returns the trained params and the evaluations
    [{"step", "heldout_loss"}]."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ocp, manager = _manager(workdir)
    latest = manager.latest_step()
    try:
        _check_run(workdir, run, resuming=latest is not None)
    except BaseException:  # refused: the manager's threads end here, not with the process
        manager.close()
        raise
    state = TrainState(params, optimizer(cfg).init(params), jnp.zeros((), jnp.int32))
    if latest is not None:
        state = manager.restore(latest, args=ocp.args.StandardRestore(state))
        log.info("resumed from step %d in %s", latest, workdir)
    step = int(state.step)
    history: list[dict] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=cfg.steps, initial=step, desc="train", unit="step", dynamic_ncols=True)
    t_start, tokens_done = time.perf_counter(), 0
    loss, loss_arr = math.nan, 0.0  # loss_arr: the last step's (0.0: none taken yet)

    def checkpoint():
        if not math.isfinite(float(loss_arr)):  # never overwrite good checkpoints with NaN
            message = (f"training diverged: the loss is {float(loss_arr)} at step "
                       f"{int(state.step)}; {workdir} keeps its last checkpoint (step "
                       f"{manager.latest_step()}). Lower the learning rate or check the data")
            manager.close()
            raise FloatingPointError(message)
        manager.save(int(state.step), args=ocp.args.StandardSave(state))
        manager.wait_until_finished()

    def run_eval():
        if evaluate_fn is None:
            return
        value = evaluate_fn(state.params)
        history.append({"step": int(state.step), "heldout_loss": value})
        if on_eval:
            on_eval(int(state.step), value)
        log.info("step %d held-out loss %.4f", int(state.step), value)

    try:
        while step < cfg.steps:
            batch = (sample_batch(tokens, cfg.batch_size, cfg.seq_len, cfg.seed, step)
                     if batches is None else batches(step))
            state, loss_arr = _step(objective, cfg, state, jax.tree.map(jnp.asarray, batch), aux)
            step += 1
            tokens_done += cfg.batch_size * cfg.seq_len
            if step % cfg.checkpoint_every == 0:
                checkpoint()
            if step % cfg.eval_every == 0:
                run_eval()
            if bar is not None:
                loss = float(loss_arr)
                rate = tokens_done / (time.perf_counter() - t_start)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:.0f}")
            if max_seconds is not None and time.perf_counter() - t_start > max_seconds:
                log.info("time budget reached at step %d", step)
                break
    finally:
        if bar is not None:
            bar.close()
    if manager.latest_step() != step:
        checkpoint()
    if not history or history[-1]["step"] != step:
        run_eval()
    manager.close()
    return state.params, history
