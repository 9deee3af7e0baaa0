"""The visually grounded sentence encoder's pipeline pieces: losses, image targets, training objective,
embedding sentences and attention heatmaps (the model is :mod:`pipeline.embedding.sentence_encoder`)."""
