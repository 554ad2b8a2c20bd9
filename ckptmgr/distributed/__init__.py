"""Multi-rank checkpoints over ``torch.distributed``: the ranks' coordination
(:mod:`.coordinator`), each rank's share of a save and the coordinated commit (:mod:`.save`),
and restore with broadcast of replicated tensors (:mod:`.restore`). See docs/DISTRIBUTED.md."""
