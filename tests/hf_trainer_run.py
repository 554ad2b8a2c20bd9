"""A Hugging Face Trainer run for the kill-and-resume tests (run as a subprocess).

    python hf_trainer_run.py OUT_DIR RESULT_JSON --trainer {ckptmgr,stock} [--resume | --resume-from DIR]
        [--max-steps N] [--save-steps K] [--hang-at-save S --hang-file NAME --marker PATH]
        [--best STEP] [--no-exchange]

With RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, each process is a DDP rank (gloo) and
writes RESULT_JSON.<rank>. A tiny Llama built from a config (no downloads), dropout on so that the RNG state matters.
Every step's exact loss (``float.hex``) goes to RESULT_JSON as the run goes, and the final
weights to RESULT_JSON + ".safetensors". With ``--hang-at-save S``, the S-th checkpoint's
write of file NAME stops half-way (after the bytes are on disk), creates PATH and blocks:
the test SIGKILLs the process there, mid-save. With ``--best STEP``, an evaluation at every
save gives ``eval_score`` highest at STEP, with ``load_best_model_at_end``. With
``KILL_POINTS`` set, the file operations under OUT_DIR are held for the test
(tests/kill_points.py); ``--no-exchange`` makes the directory exchange unavailable, as on a
file system without ``renameat2(RENAME_EXCHANGE)``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import kill_points
import torch
from safetensors.torch import save_file
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Tokens(Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 96, length: int = 16) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randint(0, 128, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=0.1)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _hang_writes(save_index: int, name: str, marker: str) -> None:
    """Make the ``save_index``-th write of ``name`` stop half-way and block forever."""
    from ckptmgr.integrations import _fileset

    original = _fileset.write_file
    seen = {"n": 0}

    def write_file(path, data, pool, chunk_size):  # type: ignore[no-untyped-def]
        if os.path.basename(path) == name:
            seen["n"] += 1
            if seen["n"] == save_index:
                arr = _fileset.np.frombuffer(data, dtype=_fileset.np.uint8)
                with open(path, "wb") as f:
                    f.write(arr[: arr.size // 2].tobytes())
                    f.flush()
                    os.fsync(f.fileno())
                with open(marker + ".tmp", "w") as f:  # renamed: the test never sees it half-written
                    f.write(path)
                os.rename(marker + ".tmp", marker)
                threading.Event().wait()  # until SIGKILL
        return original(path, data, pool, chunk_size)

    _fileset.write_file = write_file


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("result")
    p.add_argument("--trainer", choices=("ckptmgr", "stock"), required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--save-steps", type=int, default=4)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--hang-at-save", type=int, default=0)
    p.add_argument("--hang-file", default="optimizer.pt")
    p.add_argument("--marker", default="")
    p.add_argument("--resume-from", default="")
    p.add_argument("--best", type=int, default=0)
    p.add_argument("--no-exchange", action="store_true")
    a = p.parse_args()
    if a.no_exchange:
        try:
            from ckptmgr.storage.commit import directory as _dirreplace
        except ImportError:  # a version without the exchange: nothing to turn off
            pass
        else:
            _dirreplace._exchange_fn = False
    kill_points.install()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # one result per rank
        a.result = f"{a.result}.{os.environ['RANK']}"
    if a.hang_at_save:
        _hang_writes(a.hang_at_save, a.hang_file, a.marker)

    losses: dict[int, str] = {}

    def record(trainer: Trainer, loss: torch.Tensor) -> None:
        losses[trainer.state.global_step + 1] = float(loss.detach()).hex()
        with open(a.result, "w") as f:
            json.dump({"losses": losses}, f)

    base: type[Trainer]
    if a.trainer == "ckptmgr":
        from ckptmgr.integrations.transformers import CkptmgrTrainer

        base = CkptmgrTrainer
    else:
        base = Trainer

    class Recording(base):  # type: ignore[valid-type, misc]
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            record(self, loss)
            return loss

        def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):  # type: ignore[no-untyped-def]
            if not a.best:
                return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
            metrics = {f"{metric_key_prefix}_score": -abs(self.state.global_step - a.best)}
            self.log(metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            return metrics

    args = TrainingArguments(output_dir=a.out, max_steps=a.max_steps, save_steps=a.save_steps,
                             save_total_limit=a.save_total_limit, per_device_train_batch_size=4,
                             learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, seed=7,
                             dataloader_num_workers=0, disable_tqdm=True,
                             ddp_backend="gloo" if world > 1 else None,
                             **({"eval_strategy": "steps", "eval_steps": a.save_steps, "load_best_model_at_end": True,
                                 "metric_for_best_model": "score", "greater_is_better": True} if a.best else {}))
    trainer = Recording(model=tiny_llama(), args=args, train_dataset=Tokens(),
                        eval_dataset=Tokens(8) if a.best else None)
    trainer.train(resume_from_checkpoint=a.resume_from or (True if a.resume else None))
    weights = {k: v.detach().contiguous().clone() for k, v in trainer.model.state_dict().items()}
    weights.pop("lm_head.weight", None)  # tied to the embedding when the config ties them
    save_file(weights, a.result + ".safetensors")
    print("done", trainer.state.global_step, file=sys.stderr)


if __name__ == "__main__":
    main()
