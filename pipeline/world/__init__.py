"""The embedded synthetic world: a deterministic captioning dataset made of shapes on textured backgrounds.

* :mod:`pipeline.world.vocab`    the closed vocabulary (shapes, colours, sizes, backgrounds, numbers)
* :mod:`pipeline.world.scene`    sampling a scene (objects, sizes, positions with limited overlap)
* :mod:`pipeline.world.geometry` relations and positions computed from boxes (the captions' semantics)
* :mod:`pipeline.world.render`   drawing a scene to an RGB image
* :mod:`pipeline.world.captions` five varied captions per scene (classes, attributes, counts, relations)
* :mod:`pipeline.world.export`   Karpathy ``dataset_coco.json``, COCO captions and COCO instances (+ attributes)
* :mod:`pipeline.world.generate` the stage: generate N images to a folder, resumable
"""
