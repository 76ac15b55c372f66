"""experiments/quickstart.ipynb runs top to bottom (nbclient, a fresh kernel, in a scratch
folder), so it cannot rot: its cells assert that speculation equals greedy decoding for every
method and that the sharded run equals one device, and its last cell writes the bench's PNGs."""

import pathlib

import nbclient  # the test extras install nbclient, nbformat and ipykernel
import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_quickstart_notebook_runs_top_to_bottom(tmp_path):
    nb = nbformat.read(ROOT / "experiments" / "quickstart.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        "commit the notebook without outputs"
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    # one cell's stream may arrive in several pieces (the kernel flushes on a timer): joined
    # as written
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.outputs)
    assert "identical to autoregressive decoding: True" in printed
    for method in ("draft_model", "ngram", "suffix", "medusa", "eagle", "dflash", "mtp"):
        line = next(x for x in printed.splitlines() if x.startswith(f"{method:12} γ="))
        assert line.endswith("identical: True"), line
    assert "8 CPU devices" in printed and "sharded equals one device: True" in printed
    for name in ("speedup_vs_gamma.png", "acceptance_per_position.png", "tpot.png"):
        assert (tmp_path / "quickstart-plots" / name).read_bytes()[:4] == b"\x89PNG"
