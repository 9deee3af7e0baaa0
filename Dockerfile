# butd-caption: CUDA runtime image (GPU extraction, training and captioning; also runs on CPU).
#   docker build -t butd-caption .
#   docker run --gpus all --rm -v "$PWD/runs:/work/runs" butd-caption demo --out runs/demo
# The PyPI torch 2.14.1 wheels are built for CUDA 13.0 (cu130) and bring their own CUDA libraries;
# the base image matches that CUDA version. The host needs an NVIDIA driver that supports CUDA 13.0.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Python 3.12 (Ubuntu 24.04) and Java 17 for pycocoevalcap (PTB tokenizer, METEOR; SPICE optional).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv openjdk-17-jre-headless ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

WORKDIR /opt/butd-caption
# Dependencies first, so code edits do not re-download torch.
COPY pyproject.toml constraints.txt README.md ./
RUN python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; open('/tmp/req.txt', 'w').write('\n'.join(d))" \
 && pip install -c constraints.txt -r /tmp/req.txt

COPY cli.py ./
COPY pipeline ./pipeline
COPY models ./models
COPY extractors ./extractors
COPY configs ./configs
# Editable install: the package reads configs/ next to the code.
RUN pip install --no-deps -e .

# Non-root user. pycocoevalcap's PTB tokenizer writes temporary files next to its jar, so that folder
# must be writable by the user running the evaluation.
RUN useradd --create-home --shell /bin/bash --uid 10001 butd \
 && chown -R butd /opt/venv/lib/python3*/site-packages/pycocoevalcap \
 && mkdir -p /work && chown butd /work
USER butd
WORKDIR /work
ENV BUTD_NO_PROGRESS=1

ENTRYPOINT ["butd-caption"]
CMD ["--help"]
