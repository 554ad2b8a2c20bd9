"""Multi-rank checkpoints over ``torch.distributed``: the ranks' coordination
(:mod:`.coordinator`), each rank's share of a save and the coordinated commit (:mod:`.save`),
and restore at any world size and layout (:mod:`.restore`): the saved ranks' state trees
(:mod:`.skeletons`), where shards lie (:mod:`.shards`), which parts of them a rank needs
(:mod:`.reshard`), verified reads of those parts (:mod:`.ranged`), and whole tensors for
export (:mod:`.consolidate`). See docs/DISTRIBUTED.md."""
