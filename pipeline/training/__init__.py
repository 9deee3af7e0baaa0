"""Training: building blocks and the loop.

* :mod:`.losses` (label-smoothed NLL), :mod:`.schedules` (paper LR schedules), :mod:`.scst` (rewards,
  baselines, policy-gradient loss) - pure functions and resumable objects;
* :mod:`.recipe` (a model YAML's ``schedule:`` -> :class:`~.recipe.StageRecipe`), :mod:`.xe` and
  :mod:`.scst_step` (the loss of one batch), :mod:`.batches` (batch order, preloading, sharding),
  :mod:`.validation` (decode + fast CIDEr-D / COCO metrics), :mod:`.engine` (the captioner trainer),
  :mod:`.api` (``train_captioner``, ``evaluate_checkpoint``).

Device, DDP, precision, seeding, signals, the non-finite check, the optimizer step and the resume
bookkeeping are the training core's (:mod:`pipeline.core.training`, :mod:`pipeline.core.distributed`),
shared with the sentence encoder and the detector trainers.
"""
