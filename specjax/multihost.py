"""Sharded generation across processes with jax.distributed (multi-host recipe).

Every process runs this same script; together they form one mesh over all their devices.

On a TPU pod slice (every host runs the same command; JAX finds the coordinator itself):

    python -m specjax.multihost --target ckpt/ --draft draft/ --model 8

On GPU nodes (one process per node, or per GPU), name the coordinator and each process's id:

    python -m specjax.multihost --coordinator host0:1234 --num-processes 2 --process-id 0 ...
    python -m specjax.multihost --coordinator host0:1234 --num-processes 2 --process-id 1 ...

Here, on one CPU machine (two local processes, loopback, 4 CPU devices each, gloo collectives):

    python -m specjax.multihost --local-demo

--target and --draft are model folders every process can read at the same path (a copy on each
host, or a shared file system; ``sj.load_model`` reads local paths only). Each process reads only
the slices of the target its own devices hold (``sj.load_model(path, mesh=)``); the draft is
replicated. Without them it builds a small random target and draft from --seed, identically in
every process (``tiny_pair``). Every process passes the whole batch of prompts to
``sj.generate(..., mesh=mesh)``: the rows are split over "data", the target over "model", and
every process gets the whole result. Process 0 prints it (with --json, also writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def run(args) -> int:
    import jax
    if args.cpu_devices:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.reference:
        pass  # one process, no mesh: the result the distributed run must reproduce
    elif args.coordinator or args.num_processes:
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.num_processes, process_id=args.process_id)
    else:
        jax.distributed.initialize()  # TPU pods and SLURM/MPI-style clusters: auto-detected
    import numpy as np

    import specjax as sj

    if not args.reference and (args.model < 1 or jax.device_count() % args.model):
        raise SystemExit(f"--model {args.model} must divide the {jax.device_count()} devices "
                         f"of all processes (the rest form the data axis)")
    mesh = (None if args.reference
            else sj.make_mesh(data=jax.device_count() // args.model, model=args.model))
    if args.target:  # straight into the mesh's layout: each process reads its own slices
        target = sj.load_model(args.target, mesh=mesh)
        draft = sj.load_model(args.draft, mesh=mesh, replicate=mesh is not None)
    else:
        target, draft = tiny_pair(args.seed)
    prompts = [[1 + i, 2 + i, 3 + 2 * i, 4] for i in range(args.batch)]
    out = {}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        gen = sj.generate(target, prompts, mesh=mesh, draft=draft, spec=sj.SpecConfig(),
                          sampling=sj.SamplingParams(temperature=temperature,
                                                     max_new_tokens=args.max_new_tokens),
                          key=args.seed)
        out[name] = gen.tokens.tolist()
    if jax.process_count() > 1:  # key=None: one fresh seed, drawn alike by every process
        from jax.experimental import multihost_utils

        from .engine import _as_key
        keys = multihost_utils.process_allgather(jax.random.key_data(
            _as_key(None, shared=True))[None])  # as a call on this mesh over every process draws
        out["fresh_keys_agree"] = bool((np.asarray(keys) == np.asarray(keys)[0]).all())
    if jax.process_index() == 0:
        print(f"{jax.process_count()} processes, {jax.device_count()} devices "
              f"({jax.local_device_count()} local), mesh "
              f"{dict(mesh.shape) if mesh is not None else None}")
        for name, rows in out.items():
            print(name, np.asarray(rows)[:, :12].tolist() if isinstance(rows, list) else rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f)
    if not args.reference:
        jax.distributed.shutdown()
    return 0


def tiny_pair(seed: int):
    """The small random target and draft the script runs without --target (same in every
    process for one seed)."""
    import jax

    import specjax as sj
    target = sj.init_model(sj.ModelConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256),
        jax.random.key(seed), init_std=0.3)
    draft = sj.init_model(sj.ModelConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256),
        jax.random.key(seed + 1), init_std=0.3)
    return target, draft


def local_demo(args) -> int:
    """Two processes on this machine, 4 CPU devices each, talking over loopback."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    base = [sys.executable, "-m", "specjax.multihost", "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", "2", "--cpu-devices", "--model", str(args.model),
            "--batch", str(args.batch), "--max-new-tokens", str(args.max_new_tokens),
            "--seed", str(args.seed)]
    if args.target:
        base += ["--target", args.target, "--draft", args.draft]
    procs = [subprocess.Popen(base + ["--process-id", str(i)]
                              + (["--json", args.json] if args.json and i == 0 else []),
                              env=env) for i in range(2)]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:  # a timeout or Ctrl-C: no process left running
        for p in procs:
            if p.poll() is None:
                p.kill()
    return max(codes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", help="host:port of process 0 (omit on TPU pods)")
    ap.add_argument("--num-processes", type=int)
    ap.add_argument("--process-id", type=int)
    ap.add_argument("--cpu-devices", action="store_true", help="CPU devices: gloo collectives")
    ap.add_argument("--local-demo", action="store_true",
                    help="start two local processes with 4 CPU devices each")
    ap.add_argument("--reference", action="store_true",
                    help="one process, one device, no mesh (the result to compare with)")
    ap.add_argument("--target", help="target model folder, the same path in every process")
    ap.add_argument("--draft", help="draft model folder (required with --target)")
    ap.add_argument("--model", type=int, default=4, help='devices on the "model" axis')
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="process 0 writes the tokens here")
    args = ap.parse_args()
    if bool(args.target) != bool(args.draft):
        ap.error("--target and --draft go together: give both model folders, or neither")
    if args.model < 1:
        ap.error(f"--model must be >= 1, got {args.model}")
    return local_demo(args) if args.local_demo else run(args)


if __name__ == "__main__":
    sys.exit(main())
