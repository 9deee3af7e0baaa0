"""Caption data: tokenisation, the `prepare` stage and the prepared-data loader."""

from pipeline.caption_data.prepared import PreparedCaptions

__all__ = ["PreparedCaptions"]
