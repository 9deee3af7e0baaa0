"""Captioning raw photos: detector -> regions -> captioner -> captions (``cli caption``), and pictures."""
