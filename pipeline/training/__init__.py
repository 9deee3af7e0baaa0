"""Training building blocks: losses (:mod:`.losses`), learning-rate schedules (:mod:`.schedules`) and
self-critical advantages (:mod:`.scst`). The training loop itself builds on these."""
