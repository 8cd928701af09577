# One image for the API, the workers and the migration job.
FROM python:3.11-slim
WORKDIR /app
# gcc/g++: Inductor compiles the denoiser's blocks to C++ on a CPU worker, and Triton builds
# its kernels' launchers with a C compiler on a GPU one.
RUN apt-get update && apt-get install -y --no-install-recommends curl gcc g++ && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY agentloop ./agentloop
COPY workers ./workers
COPY engine ./engine
COPY kernels ./kernels
COPY migrations ./migrations
COPY models ./models
RUN pip install --no-cache-dir -e ".[server,gpu]"
ENV AGENTLOOP_MODELS_DIR=/app/models
