"""The README's own code: its resume block, taken from README.md as it is, run as a user
would run it (twice in a row, and after a SIGKILL), ends where an uninterrupted run ends."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys

import pytest
import torch
import zygote

from ckptmgr import CheckpointManager

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
README_ROOT = "/data/run1/checkpoints"

# What the README leaves to the user: a model, an optimizer, a scheduler, a number of steps
# and a training step (deterministic in the step number, so that runs can be compared).
PRELUDE = """
import sys
import pytest
import torch
torch.set_num_threads(1)  # tiny tensors: threads only contend on a shared machine
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=300, gamma=0.5)
total_steps = 1201

def train_step(step):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
    loss = (model(x) - x[:, :1]).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    print("step", step, flush=True)
"""
POSTLUDE = """
torch.save(model.state_dict(), sys.argv[1])
print("done", flush=True)
"""


def readme_block(heading: str) -> str:
    """The first ```python block after ``heading`` in README.md."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index(f"\n{heading}\n"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, f"no python block under {heading!r}"
    return match.group(1)


def script(tmp_path, root: str) -> str:
    block = readme_block("## Resume after a restart")
    assert README_ROOT in block
    path = tmp_path / f"resume_example-{os.path.basename(root)}.py"
    path.write_text(PRELUDE + block.replace(README_ROOT, root) + POSTLUDE)
    return str(path)


def start(path: str, out: str) -> subprocess.Popen[str]:
    return zygote.Popen([sys.executable, path, out], template="torch", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True)


def finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-2000:] + err
    return out


def run(path: str, out: str) -> str:
    return finish(start(path, out))


def same(a: str, b: str) -> bool:
    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_readme_resume_block_runs_twice_and_after_a_sigkill(tmp_path):
    root = str(tmp_path / "run")
    path = script(tmp_path, root)
    ref = str(tmp_path / "ref.pt")
    killed_root = str(tmp_path / "killed")
    killed_path = script(tmp_path, killed_root)
    # the first run and the run to be killed use separate roots: they run side by side
    first_proc = start(path, ref)
    kill_at = random.Random().randint(520, 1150)
    proc = zygote.Popen([sys.executable, killed_path, str(tmp_path / "unused.pt")], template="torch",
                        stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step ") and int(line.split()[1]) >= kill_at:
            break
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    first = finish(first_proc)
    assert "step 0\n" in first and "step 1200\n" in first
    again_proc = start(path, str(tmp_path / "again.pt"))  # a restart: no step trained twice, none saved twice
    resumed = run(killed_path, str(tmp_path / "resumed.pt"))
    again = finish(again_proc)
    assert again.split()[:2] == ["step", "1001"]  # after checkpoint 1000
    assert same(ref, str(tmp_path / "again.pt"))
    first_step = int(resumed.split()[1])
    assert first_step in (501, 1001), resumed[:200]  # continued after a saved step, not at 0
    assert same(ref, str(tmp_path / "resumed.pt")), f"killed at step {kill_at}"


def test_readme_first_command_needs_only_the_public_index():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    match = re.search(r"## The two commands\n.*?```bash\n(.*?)\n```", text, re.S)
    assert match is not None
    first = match.group(1)
    assert first.startswith("python3 -m venv .venv") and "examples/demo.py" in first
    assert " install -q . " in first  # from the checkout: the package is not published
    for local in (".ci/constraints.txt", "+cpu", "/opt/", "--find-links", "--index-url", "--extra-index-url"):
        assert local not in first, local  # nothing that only our machines have
    assert "pip install ckptmgr" not in text  # not on PyPI yet


# --- the Hugging Face and accelerate snippets: a first run (nothing to resume) and a second ---

HF_PRELUDE = """
import sys
import pytest
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
forwards = 0

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x, labels):
        global forwards
        forwards += 1
        return {"loss": (self.lin(x) - labels).pow(2).mean()}

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return {"x": x, "labels": x[:1]}

model, ds, total_steps = Net(), Data(), int(sys.argv[1])
"""
HF_POSTLUDE = """
torch.save(model.state_dict(), sys.argv[2])
print("forwards", forwards, "global step", trainer.state.global_step, flush=True)
"""

ACCELERATE_PRELUDE = """
import sys
import pytest
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
total_steps = int(sys.argv[1])

def train_step(step):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
    loss = (model(x) - x[:, :1]).pow(2).mean()
    opt.zero_grad()
    accelerator.backward(loss)
    opt.step()
    print("step", step, flush=True)
"""
ACCELERATE_POSTLUDE = """
torch.save(accelerator.unwrap_model(model).state_dict(), sys.argv[2])
print("done", flush=True)
"""


def snippet(tmp_path, heading: str, prelude: str, postlude: str, run_dir: str, every: str) -> str:
    """The README's block under ``heading``, saving into ``run_dir`` every 5 steps instead of
    every 500 (``every``: the text that says 500 there)."""
    block = readme_block(heading)
    assert '"run1"' in block and every in block
    block = block.replace(every, every.replace("500", "5"))
    path = tmp_path / f"snippet-{abs(hash(heading))}-{os.path.basename(run_dir)}.py"
    path.write_text(prelude + block.replace('"run1"', repr(run_dir)) + postlude)
    return str(path)


def start_snippet(path: str, steps: int, out: str) -> subprocess.Popen[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    return zygote.Popen([sys.executable, path, str(steps), out], template="lightning", stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, env=env, cwd=os.path.dirname(path))


def finish_snippet(proc: subprocess.Popen[str]) -> str:
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    return out


def run_snippet(path: str, steps: int, out: str) -> str:
    return finish_snippet(start_snippet(path, steps, out))


def test_readme_hugging_face_snippet_runs_on_a_first_and_a_second_run(tmp_path):
    run_dir = str(tmp_path / "hf")
    path = snippet(tmp_path, "### Hugging Face Trainer: `CkptmgrTrainer`", HF_PRELUDE, HF_POSTLUDE, run_dir,
                   "save_steps=500")
    first = run_snippet(path, 6, str(tmp_path / "first.pt"))  # nothing to resume: starts fresh
    assert "forwards 6 global step 6" in first
    assert sorted(os.listdir(run_dir)) == ["checkpoint-5", "checkpoint-6"]  # save_steps, and the end
    second = run_snippet(path, 11, str(tmp_path / "second.pt"))  # resumes from checkpoint-6
    assert "forwards 5 global step 11" in second
    assert sorted(os.listdir(run_dir)) == ["checkpoint-10", "checkpoint-11", "checkpoint-6"]  # KeepLatest(3)


def test_readme_accelerate_snippet_runs_on_a_first_and_a_second_run(tmp_path):
    path = snippet(tmp_path, "### accelerate: `AsyncStateSaver`", ACCELERATE_PRELUDE, ACCELERATE_POSTLUDE,
                   str(tmp_path / "acc"), "% 500 == 0")
    ref_path = snippet(tmp_path, "### accelerate: `AsyncStateSaver`", ACCELERATE_PRELUDE, ACCELERATE_POSTLUDE,
                       str(tmp_path / "ref"), "% 500 == 0")
    ref = start_snippet(ref_path, 11, str(tmp_path / "ref.pt"))  # one run, never interrupted (its own root, beside)
    first = run_snippet(path, 6, str(tmp_path / "first.pt"))  # nothing to resume: starts fresh
    assert first.split()[:2] == ["step", "0"] and "step 5\n" in first
    second = run_snippet(path, 11, str(tmp_path / "second.pt"))  # resumes after its 5th step
    assert second.split()[:2] == ["step", "5"] and "step 10\n" in second
    finish_snippet(ref)
    assert same(str(tmp_path / "ref.pt"), str(tmp_path / "second.pt"))



CALLBACK_PRELUDE = """
import sys
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
forwards = 0

class Out:
    def __init__(self, loss):
        self.loss = loss

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x):
        global forwards
        forwards += 1
        print("forward", forwards, flush=True)
        if forwards == pause_at:  # hold here until the test has signalled
            sys.stdin.readline()
        return Out((self.lin(x) - x[:, :1]).pow(2).mean())

model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
state = {"model": model, "optim": opt, "sched": sched}
batch = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
total_steps = int(sys.argv[1])
pause_at = int(sys.argv[3]) if len(sys.argv) > 3 else 0
"""
CALLBACK_POSTLUDE = """
torch.save(model.state_dict(), sys.argv[2])
print("done", ckpt.resumed_step, forwards, flush=True)
"""


def callback_snippet(tmp_path, root: str) -> str:
    """The README's plain-loop block, saving into ``root`` every 5 steps instead of every 500."""
    block = readme_block("### Plain loops: `CheckpointCallback`")
    assert README_ROOT in block and "every_n_steps=500" in block
    block = block.replace(README_ROOT, root).replace("every_n_steps=500", "every_n_steps=5")
    path = tmp_path / f"callback-{os.path.basename(root)}.py"
    path.write_text(CALLBACK_PRELUDE + block + CALLBACK_POSTLUDE)
    return str(path)


def test_readme_callback_snippet_stops_on_sigterm_and_resumes_after_the_step_it_saved(tmp_path):
    """The plain-loop block as written: a first run (nothing to resume) stopped by a SIGTERM
    saves the step it is in and ends cleanly; the second run resumes after it and ends where a
    run never interrupted ends."""
    ref = str(tmp_path / "ref.pt")
    ref_proc = start_snippet(callback_snippet(tmp_path, str(tmp_path / "ref")), 23, ref)  # its own root, beside
    root = str(tmp_path / "preempted")
    path = callback_snippet(tmp_path, root)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = zygote.Popen([sys.executable, path, "23", str(tmp_path / "unused.pt"), "8"], template="torch",
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    for line in proc.stdout:
        if line == "forward 8\n":  # step 7's forward, held until the signal is sent
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(input="go\n", timeout=300)
    assert proc.returncode == 0, out
    assert out.split()[-3:] == ["done", "None", "8"]  # a first run: nothing resumed; stopped after step 7
    assert finish_snippet(ref_proc).split()[-3:] == ["done", "None", "23"]  # one run, never interrupted
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.latest_step() == 7  # the step it was in, durable before it stopped (5 may be superseded)
    resumed = run_snippet(path, 23, str(tmp_path / "resumed.pt"))
    assert resumed.split()[-3:] == ["done", "7", "15"]  # steps 8-22
    assert same(ref, str(tmp_path / "resumed.pt"))


# --- what the examples and the README tell users to install ---

def _dists(extras: dict, names: list[str]) -> set[str]:
    """The distributions the extras ``names`` install: their requirements and, where installed
    here, those requirements' own (module names: lower case, ``-`` as ``_``)."""
    from importlib.metadata import PackageNotFoundError, requires

    def name(req: str) -> str:
        return re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("-", "_")

    out: set[str] = set()
    for e in names:
        for req in extras[e]:
            out.add(name(req))
            try:
                out |= {name(r) for r in requires(name(req)) or [] if "extra ==" not in r}
            except PackageNotFoundError:
                pass
    return out


def test_every_example_says_which_extra_installs_what_it_imports():
    import ast

    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(os.path.dirname(README), "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    examples = os.path.join(os.path.dirname(README), "examples")
    for fname in sorted(os.listdir(examples)):
        if not fname.endswith(".py"):
            continue
        with open(os.path.join(examples, fname), encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source)
        mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0
                 and n.module}
        third = {m for m in mods if m not in sys.stdlib_module_names and m not in ("torch", "numpy", "ckptmgr")}
        said = re.findall(r"pip install '\.\[([\w,]+)\]'", ast.get_docstring(tree) or "")
        if third:
            assert said, f"{fname} imports {sorted(third)} but does not say which extra installs them"
        names = [e for s in said for e in s.split(",")]
        assert all(e in extras for e in names), (fname, names)
        missing = third - _dists(extras, names)
        assert not missing, f"{fname}: {sorted(missing)} not installed by pip install '.[{','.join(names)}]'"
    with open(README, encoding="utf-8") as f:
        text = f.read()
    assert "ckptmgr[" not in text  # not on PyPI yet: extras are installed from the checkout, '.[s3]'
    assert not [e for e in re.findall(r"'\.\[([\w,]+)\]'", text) for x in e.split(",") if x not in extras]


# --- the README is about usage: guides in docs/, figures in benchmarks/RESULTS.md ---

def test_readme_links_a_guide_per_integration_and_takes_its_figures_from_the_results():
    import json

    here = os.path.dirname(README)
    with open(README, encoding="utf-8") as f:
        text = f.read()
    for page in ("HUGGINGFACE.md", "TORCHTITAN.md", "LIGHTNING.md", "LOCAL_TIER.md"):
        assert os.path.isfile(os.path.join(here, "docs", page)) and f"(docs/{page})" in text, page
    # benchmark figures (seconds, percentages, GB/s) only in the Benchmarks section's summary,
    # each of them a value of the chart's report, rounded as printed
    start = text.index("\n## Benchmarks\n")
    bench = text[start:text.index("\n## ", start + 1)]  # (the next section checks its own figures)
    usage = text[:start]
    assert not re.findall(r"\d+(?:\.\d+)?\s?(?:%|GB/s)", usage)
    assert not re.findall(r"\b\d+\.\d+ s\b", usage)  # (timeouts such as "60 s" are not figures)
    assert not re.findall(r"\b\d+(?:\.\d+)?\s?ms\b", usage)  # step and copy times
    with open(os.path.join(here, "benchmarks", "results", "h200-2026-11-23i", "report", "summary.json")) as f:
        metrics = json.load(f)["metrics"]
    values = [v for m in metrics.values() for v in m.values() if isinstance(v, (int, float))]
    figures = re.findall(r"\b(\d+\.\d+) s\b", bench)
    assert len(figures) >= 4
    for fig in figures:
        digits = len(fig.split(".")[1])
        assert any(f"{v:.{digits}f}" == fig for v in values), f"{fig} s is not in summary.json"
    with open(os.path.join(here, "docs", "LOCAL_TIER.md"), encoding="utf-8") as f:
        tier = f.read()
    for what in ("## Where", "## When a step is written", "## When it is cleaned", "## How to drop it"):
        assert what in tier


def test_readme_checkpoint_frequency_table_comes_from_its_json():
    """The "How often can I checkpoint" section: every overhead figure in its table is the
    median, minimum or maximum over the rounds (two or more) of the JSON it names, for the
    configuration of its row; the figures in its text come from the JSON named beside them."""
    import json
    import statistics

    here = os.path.dirname(README)
    with open(README, encoding="utf-8") as f:
        text = f.read()
    start = text.index("\n## How often can I checkpoint\n")
    assert start > text.index("\n## Benchmarks\n")  # figures only after the usage sections
    end = text.find("\n## ", start + 1)
    section = text[start:end if end != -1 else len(text)]
    results = os.path.join(here, "benchmarks", "results")

    def pct(path: str, mode: str) -> list[float]:
        assert f"benchmarks/results/{path}" in section, path
        with open(os.path.join(results, path)) as f:
            return json.load(f)["summary"][mode]["overhead_pct"]

    def spread(values: list[float]) -> set[str]:
        assert len(values) >= 2  # fresh-process rounds
        return {f"{v:+.2f}%" for v in (statistics.median(values), min(values), max(values))}

    modes = {"the defaults": ("h200-2026-11-28-defaults/call4/defaults.json", "ckptmgr overlap"),
             "Schedule(continuous=True)": ("h200-2026-11-28-defaults/call1/budget.json", "ckptmgr continuous"),
             "Schedule(max_lost_s=2)": ("h200-2026-11-28-defaults/call3/ln.json", "ckptmgr lost")}
    rows = {row: spread(pct(path, mode)) for row, (path, mode) in modes.items()}
    rounds = {}
    for path in {path for path, _ in modes.values()}:
        with open(os.path.join(results, path)) as f:
            rounds[path] = json.load(f)["rounds"]
    seen = 0
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        found = re.findall(r"[+-]\d+\.\d+%", line)
        if not line.startswith("| ") or not found:
            continue
        assert set(found) == rows[cells[0]], (line, rows[cells[0]])
        # the seconds the schedule achieved: each a value of its stats in some round, as printed
        path, mode = modes[cells[0]]
        stats = [v for r in rounds[path] for k, v in (r[mode]["stats"] or {}).items() if isinstance(v, (int, float))]
        for fig in re.findall(r"\d+\.\d+", cells[-1]):
            digits = len(fig.split(".")[1])
            assert any(f"{v:.{digits}f}" == fig for v in stats), (fig, line)
        seen += 1
    assert seen == len(rows)
    prose = {f"{v:+.2f}%" for path, mode in (("h200-2026-11-28-defaults/call3/ln.json", "ckptmgr overlap"),
                                             ("h200-2026-11-28-defaults/call1/budget.json", "ckptmgr overlap"),
                                             ("h200-2026-11-28-defaults/call2/budget-long.json", "ckptmgr budget"),
                                             ("h200-2026-11-28-defaults/call3/dn.json", "ckptmgr overlap"),
                                             ("h200-2026-11-28-defaults/call1/decoder.json", "ckptmgr overlap"))
             for values in [pct(path, mode)] for v in (statistics.median(values), min(values), max(values))}
    old = []
    for name in ("old1.json", "old2.json", "old3.json"):
        assert f"{name}`" in section
        with open(os.path.join(results, "h100-2026-11-27-defaults", name)) as f:
            old += json.load(f)["summary"]["ckptmgr overlap"]["overhead_pct"]
    prose.add(f"{statistics.median(old):+.1f}%")
    table = {line for line in section.splitlines() if line.startswith("| ")}
    text_figures = {f for line in section.splitlines() if line not in table for f in re.findall(r"[+-]\d+\.\d+%", line)}
    assert text_figures == prose, (text_figures, prose)
