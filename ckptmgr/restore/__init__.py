"""The restore path: which copy of a step to read and the fallback to an older one
(:mod:`.restorer`), the loaders that bring files into memory (:mod:`.loaders`), verification
without loading (:mod:`.verify`), and landing the result in a target state (:mod:`.apply`)."""
