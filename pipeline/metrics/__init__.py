"""Caption metrics: fast CIDEr-D (:mod:`.cider`) and the COCO caption metrics (:mod:`.coco`)."""
