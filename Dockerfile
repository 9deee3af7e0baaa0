# butd-caption: one image for CPU and GPU (extraction, training, captioning, serving, benchmarks).
#   docker build -t butd-caption .
#   mkdir -p runs
#   docker run --gpus all --rm -t --ipc=host --user "$(id -u):$(id -g)" -v "$PWD/runs:/work/runs" butd-caption demo --out runs/demo
# The PyPI torch wheels bring their own CUDA libraries (the nvidia-* wheels), so the base is plain Python, not an
# nvidia/cuda image: only the host's NVIDIA driver is needed (the NVIDIA Container Toolkit mounts it with
# --gpus). The torch pinned in constraints.txt is built for CUDA 13.0: the driver must support CUDA 13.0.
# Python 3.11, the Python constraints.txt was made and is tested with (Linux x86-64); Debian bookworm for
# openjdk-17 (pycocoevalcap's PTB tokenizer and METEOR; SPICE optional).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
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

# Dependencies first, from the lock alone (no README, docs or code in this layer): a code or docs edit reuses it.
# --no-deps + pip check: exactly the pinned set, consistent. pycocoevalcap's PTB tokenizer writes temporary
# files next to its jar, so that folder is made writable by any uid here, in the same layer (not a copy later).
COPY constraints.txt /opt/butd-caption/constraints.txt
RUN pip install --no-deps -r /opt/butd-caption/constraints.txt \
 && pip check \
 && chmod -R a+rwX /opt/venv/lib/python3*/site-packages/pycocoevalcap

# Any uid may run the image (`--user "$(id -u):$(id -g)"` makes files in a bind mount yours): HOME and every
# cache point into /tmp (writable by any uid, gone with the container), so a run writes nothing but its outputs,
# under the mounted /work.
RUN mkdir -p /tmp/home /tmp/cache && chmod 1777 /tmp/home /tmp/cache \
 && mkdir -p /work && chmod 1777 /work \
 && useradd --create-home --shell /bin/bash --uid 10001 butd

WORKDIR /opt/butd-caption
COPY pyproject.toml README.md cli.py ./
COPY pipeline ./pipeline
COPY models ./models
COPY extractors ./extractors
COPY configs ./configs
COPY bench ./bench
# Editable install (the package reads configs/ next to the code), built with the pinned setuptools/wheel
# (--no-build-isolation: nothing downloaded); byte-compiled once here, since a non-root uid cannot write
# __pycache__ at run time. PYTHONPATH makes `python -m bench` work too.
RUN pip install --no-deps --no-build-isolation -e . \
 && python -m compileall -q cli.py pipeline models extractors bench
ENV PYTHONPATH=/opt/butd-caption \
    HOME=/tmp/home \
    XDG_CACHE_HOME=/tmp/cache \
    TORCH_HOME=/tmp/cache/torch \
    MPLCONFIGDIR=/tmp/cache/matplotlib \
    TORCHINDUCTOR_CACHE_DIR=/tmp/cache/inductor
USER butd
WORKDIR /work
# `serve --host 0.0.0.0` listens here (configs/serve.yaml serve.port); publish it with -p 8000:8000.
EXPOSE 8000
# Progress bars appear when a terminal is attached (`docker run -t`) and stay off in logs (no -t);
# BUTD_NO_PROGRESS=1 turns them off even with a terminal.

ENTRYPOINT ["butd-caption"]
CMD ["--help"]
