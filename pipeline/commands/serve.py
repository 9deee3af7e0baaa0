"""`cli serve`: captions over HTTP (pipeline/serving/, docs/serving.md)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from pipeline.commands.captioner_opts import CaptionerModelOpt, CaptionerOpt, DetectorWeightsOpt, VocabOpt
from pipeline.commands.grammar import DEFAULT_RUN
from pipeline.commands.options import CommandOptions, Everyday, command
from pipeline.serving.settings import settings_from

#: --batch-size: images per detector/captioner batch across requests; uploads are decoded by serve.decode_threads
#: threads
SERVE_EVERYDAY = Everyday(device="caption.device", batch_size="serve.max_batch", precision="caption.precision")


def register(app: typer.Typer) -> None:
    @command(app, "serve", everyday=SERVE_EVERYDAY, decoding=True)
    def serve_command(
        opts: CommandOptions,
        model: CaptionerModelOpt = DEFAULT_RUN,
        vocab: VocabOpt = None,
        weights: DetectorWeightsOpt = None,
        captioner: CaptionerOpt = None,
        host: Annotated[
            Optional[str],
            typer.Option("--host", help="Address to listen on (default serve.host: 127.0.0.1, this machine only)."),
        ] = None,
        port: Annotated[
            Optional[int], typer.Option("--port", "-P", help="TCP port (default serve.port: 8000; 0 picks a free one).")
        ] = None,
        token: Annotated[
            Optional[str],
            typer.Option("--token", help="Bearer token clients must send (default: $BUTD_SERVE_TOKEN, else none)."),
        ] = None,
    ) -> None:
        """Serve captions over HTTP: POST images to /v1/captions, or open / in a browser to drop photos and see their
        captions with boxes. The models are loaded once; images of concurrent requests share detector and captioner
        batches (serve.max_batch, serve.max_wait_ms), through the engine `caption` uses, so a request gets the captions
        `caption` writes for the same model and options.

        Bounded: serve.queue_limit images admitted (503 with Retry-After beyond), serve.max_body_bytes per request
        (413), caption.max_pixels per image, serve.request_timeout_s per request (504), serve.header_timeout_s for a
        request's headers (408). Binds 127.0.0.1 unless --host says otherwise; --token (or $BUTD_SERVE_TOKEN) makes
        /v1/captions and /metrics need `Authorization: Bearer TOKEN`. Nothing is written to disk. SIGTERM or Ctrl-C:
        stops accepting, answers what is in flight, exits 0. Metrics at /metrics (Prometheus), the API at /docs and
        /openapi.json.

        Examples:

            butd-caption serve --model runs/demo

            curl -F files=@photo.jpg -F n_best=3 http://127.0.0.1:8000/v1/captions

            butd-caption serve --model best.pt --weights bua.pth --host 0.0.0.0 --token "$TOKEN" --device cuda --batch-size 16
        """  # noqa: E501 -- each example is one shell line (tests/test_cli_grammar.py parses it)
        from pipeline.serving import server  # noqa: PLC0415 -- keeps cli --help fast

        cfg = opts.resolve("serve")  # the decoding flags are decoding.* overrides, as in caption and evaluate
        settings = settings_from(cfg.serve, token, host=host, port=port)
        decoding = cfg.decoding.to_dict()
        sock = server.bind(settings.host, settings.port)  # a port in use fails before the models load
        try:
            service, batcher = server.load_service(model, weights, cfg.caption, settings, captioner, vocab, decoding)
        except BaseException:
            sock.close()
            raise
        raise typer.Exit(server.run_server(service, batcher, settings, sock))
