# GPU image running `duplex serve`. Build: docker build -t duplex .
# Run:   docker run --gpus all -p 8080:8080 -v $PWD/configs:/app/configs duplex
#        docker run --gpus all -p 8080:8080 -v /ckpt:/models duplex --model /models/qwen3-omni
#        ... duplex --config configs/cluster.toml --node-id node-1   (replicas sharing Redis)
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
RUN python3 -m venv $VIRTUAL_ENV && pip install --no-cache-dir --upgrade pip

# torch first, pinned as in pyproject.toml: the default Linux wheel is the CUDA build. Set
# TORCH_INDEX_URL to PyTorch's own wheel index for another CUDA version.
ARG TORCH_INDEX_URL=
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url $TORCH_INDEX_URL} torch==2.13.0

WORKDIR /app
COPY pyproject.toml README.md ./
COPY duplex duplex
COPY models models
COPY web_client web_client
COPY configs configs
# Editable, so the package finds web_client/ and .models/ beside it under /app.
RUN pip install --no-cache-dir -e .

# The embedded default model (tiny, random weights) so the image serves out of the box; real
# checkpoints are mounted and named with --model PATH. Nothing is downloaded at run time.
RUN duplex models build tiny-omni
# semantic_vad's end-of-turn model (Smart Turn v3.2, BSD 2-Clause), out of the pipecat-ai wheel
# on PyPI, its SHA-256 checked, with its licence beside it.
RUN duplex models build smart-turn

# configs/ is read from here: mount your own over it.
VOLUME ["/app/configs"]
EXPOSE 8080
# Alive unless the engine is down: /healthz also answers 503 "full" while the server would
# refuse a new session (for load balancers), and a full server is a healthy one.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \
  CMD python3 -c "import http.client as h, json, sys; c = h.HTTPConnection('127.0.0.1', 8080, timeout=2); c.request('GET', '/healthz'); sys.exit(json.load(c.getresponse())['status'] == 'engine_down')"
ENTRYPOINT ["duplex", "serve", "--host", "0.0.0.0"]
CMD []
