# A Linux CPU worker (MLX's CPU backend). Macs run the worker natively, on Metal.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY client ./client
COPY worker ./worker
COPY mlxq ./mlxq
COPY config ./config
RUN pip install --no-cache-dir ".[worker]"
ENV HF_HOME=/cache/hf XDG_CACHE_HOME=/cache
VOLUME /cache
ENTRYPOINT ["mlxq"]
CMD ["worker"]
