"""One module per captioner, each registering its class with :func:`models.register_captioner`, and the
contract they all implement (:mod:`models.captioners.base`). Every module here is imported when a captioner is
looked up by name, so a new captioner is one module in this package plus its model card."""
