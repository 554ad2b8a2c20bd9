"""The README's first command runs this demo: it must keep working."""

import os
import subprocess
import sys

DEMO = os.path.join(os.path.dirname(__file__), "..", "examples", "demo.py")


def test_demo_resumes_identical():
    out = subprocess.run([sys.executable, DEMO], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resumed from step" in out.stdout
    assert "IDENTICAL" in out.stdout


EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def example(name, *args, timeout=180):
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_plain_loop_example_resumes(tmp_path):
    root = str(tmp_path / "run")
    assert "starting at step 0" in example("plain_loop_resume.py", root, "--steps", "60")
    out = example("plain_loop_resume.py", root, "--steps", "120")
    assert "starting at step 41" in out and "[60, 80, 100]" in out  # saved after steps 0, 20 and 40


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
