#!/bin/sh
# docker-compose.yml's one-shot `setup` service, before any replica starts: what each replica would
# otherwise race on at its own start (docs/deploy.md, "Containers"). Replicas listen on 0.0.0.0,
# which `chatcore serve` refuses without an API key, so the first admin key is made here, once,
# into a file only the chatcore user can read.
set -eu
chatcore model fetch
chatcore migrate
key_file="$CHATCORE_DATA_DIR/admin.key"
if [ -z "$(chatcore keys list)" ]; then
    umask 077
    chatcore keys create --tenant admin --admin > "$key_file.tmp"
    mv "$key_file.tmp" "$key_file"
    echo "created the first admin key: docker compose exec replica-1 cat $key_file"
fi
