"""The save path: slots of reusable host memory (:mod:`.slots`), the device-to-host copy
into them (:mod:`.staging`), and the background write and commit of a staged step
(:mod:`.persist`)."""
