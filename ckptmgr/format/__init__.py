"""The checkpoint format, shared by the save and the restore paths: the state tree's typed
JSON skeleton (:mod:`.tree`), the file layout (:mod:`.layout`), the manifest
(:mod:`.manifest`), checksums (:mod:`.checksum`) and step naming (:mod:`.naming`); and the
torch checkpoint (zip) image the Lightning plugin writes (:mod:`.torchzip`).

Nothing here does I/O; docs/FORMAT.md describes what these modules produce.
"""
