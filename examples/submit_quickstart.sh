#!/usr/bin/env bash
# Submit the quickstart to a *running* Ray cluster through the Jobs API, token auth on.
#
#   ray start --head --dashboard-host=127.0.0.1            # or any cluster from cluster/
#   examples/submit_quickstart.sh                          # default address below
#   examples/submit_quickstart.sh http://HEAD:8265 train.epochs=3
#
# Authentication: Ray 2.60 clusters use token auth. The client reads the token from
# $RAY_AUTH_TOKEN, the file named by $RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token (what
# `ray start` created on the head; copy it, or `ray get-auth-token`, to submit remotely).
#
# Upload: --working-dir . ships the repo; Ray honours .gitignore (so .venv/ and runs/
# stay home) and the excludes below keep .git out too: the upload is well under 1 MiB.
#
# Storage: a job runs in a temporary copy of the repo, so the run directory must be an
# absolute path; on a multi-node cluster it must be storage every node can reach
# (NFS, or s3://... / gs://... for checkpoints).
#
# SUBMISSION_ID=my-run-1 names the job (`ray job submit --submission-id`), so that if this
# client loses its connection to the dashboard while it follows the job, the job itself
# goes on and `ray job status my-run-1` / `ray job logs my-run-1` find it again.
set -euo pipefail

ADDRESS="${1:-${RAY_DASHBOARD_ADDRESS:-http://127.0.0.1:8265}}"
shift $(( $# > 0 ? 1 : 0 ))
CONFIG="${CONFIG:-examples/configs/quickstart.yaml}"
STORAGE="${STORAGE:-/tmp/raytrain-ddp-runs}"
RAY="${RAY:-ray}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

cd "$(dirname "$0")/.."
exec "$RAY" job submit --address "$ADDRESS" --working-dir . ${SUBMISSION_ID:+--submission-id "$SUBMISSION_ID"} \
  --runtime-env-json '{"excludes": [".git", ".venv", "runs", "benchmarks/*.png", "*.egg-info"]}' \
  -- python -m raytrain_ddp train "$CONFIG" "run.storage_path=$STORAGE" "$@"
