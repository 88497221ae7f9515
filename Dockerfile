# One image for the tensord server and the Locust load test (see docker-compose.yml).
#   docker build -t tensord .                                  host memory only
#   docker build --build-arg EXTRAS=loadtest,cuda12 -t tensord .   with CuPy for CUDA 12
FROM python:3.11-slim

ARG EXTRAS=loadtest
WORKDIR /app
COPY pyproject.toml README.md ./
COPY client client
COPY server server
RUN pip install --no-cache-dir ".[${EXTRAS}]"

# 50051: the tensord server; 8089: Locust's web UI (when not headless)
EXPOSE 50051 8089
# Listening beyond the container needs tokens: mount a file of 'TOKEN TENANT' lines there
# (docker run -v $PWD/tokens:/run/secrets/tensord_tokens:ro, or a compose secret); without
# it the server exits saying so.  docker-compose.yml runs its own command instead.
CMD ["tensord", "serve", "--address", "0.0.0.0:50051", "--auth-tokens", "/run/secrets/tensord_tokens"]
