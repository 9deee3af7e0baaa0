"""Building blocks the captioners share: attention (:mod:`~models.layers.attention`, M2's
:mod:`~models.layers.m2_attention`, AoA's :mod:`~models.layers.aoa_layers`), bilinear attention
(:mod:`~models.layers.bilinear`), box geometry (:mod:`~models.layers.geometry`), normalisation
(:mod:`~models.layers.normalization`), the pre-norm Transformer stacks (:mod:`~models.layers.transformer`) and
dropout that can spare rows (:mod:`~models.layers.row_dropout`). Nothing here imports a captioner."""
