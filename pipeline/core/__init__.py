"""The foundation every stage builds on: configs, errors, registries, console and logging, atomic file I/O,
vocabularies, self-describing checkpoints, stage bookkeeping, and the training core shared by the three
trainers (captioners, sentence encoder, detector).

Nothing in ``pipeline.core`` imports the application packages (``pipeline.*`` stages, ``models``,
``extractors``); they import it.
"""
