"""The README's first command runs this demo: it must keep working."""

import os
import re
import sys

import zygote

DEMO = os.path.join(os.path.dirname(__file__), "..", "examples", "demo.py")


def test_demo_kills_inside_saves_and_resumes_identical():
    out = zygote.run([sys.executable, DEMO, "--seed", "7"], template="torch", capture_output=True, text=True,
                     timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resumed from step" in out.stdout
    assert "3 of 3 interrupted runs ended IDENTICAL" in out.stdout
    kills = re.findall(r"SIGKILLed ([0-9.]+) ms into the save of step (\d+) \(saves took up to ([0-9.]+) ms\)",
                       out.stdout)
    assert len(kills) == 3
    assert all(0 <= float(at) <= float(window) and float(window) > 0 for at, _, window in kills)
    assert len({(at, step) for at, step, _ in kills}) == 3  # a different moment each time
    roots = re.findall(r"under (\S+)/checkpoints", out.stdout)
    assert len(roots) == 3 and not any(os.path.exists(r) for r in roots)  # removed at the end


EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def example(name, *args, timeout=180, stderr=None):
    out = zygote.run([sys.executable, os.path.join(EXAMPLES, name), *args], template="lightning", capture_output=True,
                     text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    if stderr is not None:
        stderr.append(out.stderr)
    return out.stdout


def test_plain_loop_example_resumes(tmp_path):
    root, errors = str(tmp_path / "run"), []
    assert "starting at step 0" in example("plain_loop_resume.py", root, "--steps", "60", stderr=errors)
    out = example("plain_loop_resume.py", root, "--steps", "120", stderr=errors)
    assert "starting at step 41" in out and "[60, 80, 100]" in out  # saved after steps 0, 20 and 40
    assert not [e for e in errors if "in use by another process" in e], errors  # one manager at a time


def test_lightning_example_resumes(tmp_path):
    d = str(tmp_path / "run")
    assert "global step 16" in example("lightning_resume.py", d, "--epochs", "2")
    out = example("lightning_resume.py", d, "--epochs", "4")
    assert "finished at global step 32" in out and "last.ckpt: epoch 3, global step 32" in out


def test_s3_example_against_a_real_endpoint(s3_bucket):
    bucket, opts = s3_bucket
    out = example("s3_config.py", f"s3://{bucket}/run1", "--endpoint", opts["endpoint_url"], "--key", opts["key"],
                  "--secret", opts["secret"])
    assert "committed steps: [200, 300]" in out and "identical: True" in out
