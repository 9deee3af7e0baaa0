"""Training the bottom-up Faster R-CNN (``cli train-detector``) and evaluating it.

* :mod:`~extractors.training.data`     COCO instances with attributes -> validated records and batches
* :mod:`~extractors.training.targets`  RPN anchor targets and RoI sampling (torchvision Matcher / sampler)
* :mod:`~extractors.training.model`    the training forward pass and its losses
* :mod:`~extractors.training.optim`    freezing, SGD groups, warm-up + step schedule, BN calibration
* :mod:`~extractors.training.loop`     the resumable trainer (on the training core :mod:`pipeline.core.training`)
* :mod:`~extractors.training.export`   the ``butd`` weights file ``cli extract`` loads
* :mod:`~extractors.training.evaluate` recall / class / attribute accuracy with the extractor's selection
* :mod:`~extractors.training.stage`    ``train_detector(stage_dir, cfg)`` for :func:`pipeline.core.stages.run_stage`
"""
