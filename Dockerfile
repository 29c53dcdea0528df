# A Linux CPU worker (MLX's CPU backend). Macs run the worker natively, on Metal.
FROM python:3.11-slim
# MLX's CPU wheel ships a slow reference BLAS; the worker puts a real one in front of it:
# oneMKL from PyPI on x86_64 (the worker extra), Debian's OpenBLAS on arm64 (and as a fallback).
RUN apt-get update && apt-get install -y --no-install-recommends libopenblas0-pthread \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY client ./client
COPY common ./common
COPY worker ./worker
COPY gateway ./gateway
COPY mlxq ./mlxq
COPY config ./config
RUN pip install --no-cache-dir ".[worker]"
ENV HF_HOME=/cache/hf XDG_CACHE_HOME=/cache PYTHONUNBUFFERED=1
VOLUME /cache
ENTRYPOINT ["mlxq"]
CMD ["worker"]
