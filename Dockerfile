# butd-caption: one image for CPU and GPU (extraction, training, captioning, benchmarks).
#   docker build -t butd-caption .
#   docker run --gpus all --rm -t --ipc=host --user "$(id -u):$(id -g)" -v "$PWD/runs:/work/runs" butd-caption demo --out runs/demo
# The PyPI torch wheels bring their own CUDA libraries (the nvidia-* wheels), so the base is plain Python, not an
# nvidia/cuda image: only the host's NVIDIA driver is needed (the NVIDIA Container Toolkit mounts it with
# --gpus). The torch pinned in constraints.txt is built for CUDA 13.0: the driver must support CUDA 13.0.
# Debian bookworm for openjdk-17 (pycocoevalcap's PTB tokenizer and METEOR; SPICE optional).
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/* \
 && python -m venv /opt/venv

WORKDIR /opt/butd-caption
# Dependencies first, so code edits do not re-download torch.
COPY pyproject.toml constraints.txt README.md ./
RUN python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; open('/tmp/req.txt', 'w').write('\n'.join(d))" \
 && pip install -c constraints.txt -r /tmp/req.txt \
 && rm /tmp/req.txt

COPY cli.py ./
COPY pipeline ./pipeline
COPY models ./models
COPY extractors ./extractors
COPY configs ./configs
COPY bench ./bench
# Editable install: the package reads configs/ next to the code. PYTHONPATH makes `python -m bench` work too.
RUN pip install --no-deps -e .
ENV PYTHONPATH=/opt/butd-caption

# Any uid may run the image (`--user "$(id -u):$(id -g)"` makes files in a bind mount yours): the code is
# read-only; pycocoevalcap's PTB tokenizer writes temporary files next to its jar, so that folder is writable
# by all; HOME and every cache point into /tmp (writable by any uid, gone with the container), so a run writes
# nothing but its outputs, under the mounted /work.
RUN chmod -R a+rwX /opt/venv/lib/python3*/site-packages/pycocoevalcap \
 && mkdir -p /tmp/home /tmp/cache && chmod 1777 /tmp/home /tmp/cache \
 && mkdir -p /work && chmod 1777 /work \
 && useradd --create-home --shell /bin/bash --uid 10001 butd
ENV HOME=/tmp/home \
    XDG_CACHE_HOME=/tmp/cache \
    TORCH_HOME=/tmp/cache/torch \
    MPLCONFIGDIR=/tmp/cache/matplotlib \
    TORCHINDUCTOR_CACHE_DIR=/tmp/cache/inductor
USER butd
WORKDIR /work
# Progress bars appear when a terminal is attached (`docker run -t`) and stay off in logs (no -t);
# BUTD_NO_PROGRESS=1 turns them off even with a terminal.

ENTRYPOINT ["butd-caption"]
CMD ["--help"]
