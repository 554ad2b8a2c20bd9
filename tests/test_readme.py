"""The README's own code: its resume block, taken from README.md as it is, run as a user
would run it (twice in a row, and after a SIGKILL), ends where an uninterrupted run ends."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys

import torch

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
README_ROOT = "/data/run1/checkpoints"

# What the README leaves to the user: a model, an optimizer, a scheduler, a number of steps
# and a training step (deterministic in the step number, so that runs can be compared).
PRELUDE = """
import sys
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
    path = tmp_path / "resume_example.py"
    path.write_text(PRELUDE + block.replace(README_ROOT, root) + POSTLUDE)
    return str(path)


def run(path: str, out: str) -> str:
    r = subprocess.run([sys.executable, path, out], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    return r.stdout


def same(a: str, b: str) -> bool:
    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_readme_resume_block_runs_twice_and_after_a_sigkill(tmp_path):
    root = str(tmp_path / "run")
    path = script(tmp_path, root)
    ref = str(tmp_path / "ref.pt")
    first = run(path, ref)
    assert "step 0\n" in first and "step 1200\n" in first
    again = run(path, str(tmp_path / "again.pt"))  # a restart: no step trained twice, none saved twice
    assert again.split()[:2] == ["step", "1001"]  # after checkpoint 1000
    assert same(ref, str(tmp_path / "again.pt"))

    killed_root = str(tmp_path / "killed")
    path = script(tmp_path, killed_root)
    kill_at = random.Random().randint(520, 1150)
    proc = subprocess.Popen([sys.executable, path, str(tmp_path / "unused.pt")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step ") and int(line.split()[1]) >= kill_at:
            break
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    resumed = run(path, str(tmp_path / "resumed.pt"))
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
