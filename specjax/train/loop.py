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
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..cache import KVCache
from ..config import ModelConfig
from ..model import Model, forward, init_model
from .data import sample_batch

log = logging.getLogger(__name__)


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
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")


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
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, _, _ = forward(Model(config, params), tokens, positions, KVCache.init(config, B, T))
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


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _step(config: ModelConfig, cfg: TrainConfig, distill: bool, state: TrainState,
          batch: jax.Array, teacher: Model | None):
    if distill:
        loss_fn = lambda p: distill_loss(config, p, batch, teacher, cfg.distill_temperature,  # noqa
                                         cfg.distill_ce_weight)
    else:
        loss_fn = lambda p: lm_loss(config, p, batch)  # noqa: E731
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
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


def _check_run(workdir: pathlib.Path, config: ModelConfig, cfg: TrainConfig,
               teacher: Model | None) -> None:
    """Record the run's settings in workdir/run.json; refuse to resume with other settings."""
    run = {"model": dataclasses.asdict(config), "train": dataclasses.asdict(cfg),
           "teacher": None if teacher is None else dataclasses.asdict(teacher.config)}
    run = json.loads(json.dumps(run))
    path = workdir / "run.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old != run:
            changed = sorted(f"{part}.{k}" for part in run for k in (run[part] or {})
                             if (old.get(part) or {}).get(k) != (run[part] or {}).get(k))
            raise ValueError(f"{workdir} holds a run with other settings ({', '.join(changed)}"
                             f"); use a new work directory or the same settings")
    else:
        path.write_text(json.dumps(run, indent=1) + "\n")


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
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    _check_run(workdir, config, cfg, teacher)
    ocp, manager = _manager(workdir)
    params = (init or init_model(config, jax.random.key(cfg.seed))).params
    state = TrainState(params, optimizer(cfg).init(params), jnp.zeros((), jnp.int32))
    latest = manager.latest_step()
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
    loss = math.nan

    def checkpoint():
        manager.save(int(state.step), args=ocp.args.StandardSave(state))
        manager.wait_until_finished()

    def run_eval():
        if heldout is None:
            return
        value = evaluate(Model(config, state.params), heldout, cfg.eval_batches, cfg.batch_size,
                         cfg.seq_len)
        history.append({"step": int(state.step), "heldout_loss": value})
        if on_eval:
            on_eval(int(state.step), value)
        log.info("step %d held-out loss %.4f", int(state.step), value)

    try:
        while step < cfg.steps:
            batch = sample_batch(tokens, cfg.batch_size, cfg.seq_len, cfg.seed, step)
            state, loss_arr = _step(config, cfg, teacher is not None, state, jnp.asarray(batch),
                                    teacher)
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
    return Model(config, state.params), history
