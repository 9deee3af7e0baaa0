"""Caption data: tokenisation, the `prepare` stage and the prepared-data loader."""

from pipeline.captions.prepared import PreparedCaptions

__all__ = ["PreparedCaptions"]
