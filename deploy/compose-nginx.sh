#!/bin/sh
# docker-compose.yml's nginx: renders the three markers of deploy/nginx.conf (its header lists
# them) from NGINX_LISTEN and NGINX_UPSTREAMS ("host:port host:port ..."), logs to the process's
# output, and runs nginx in the foreground. NGINX_TEMPLATE and NGINX_PREFIX default to the
# container's paths (tests/test_containers.py runs it outside one).
set -eu
template="${NGINX_TEMPLATE:-/opt/chatcore/nginx.conf}"
prefix="${NGINX_PREFIX:-/tmp/chatcore-nginx}"
mkdir -p "$prefix/tmp"
ln -sf /dev/stdout "$prefix/access.log"
ln -sf /dev/stderr "$prefix/error.log"
servers=""
for upstream in $NGINX_UPSTREAMS; do
    servers="$servers        server $upstream max_fails=1 fail_timeout=5s;\n"
done
# Comment lines (the header names the markers) stay as they are.
sed -e "/^#/!s|@PREFIX@|$prefix|g" -e "/^#/!s|@LISTEN@|$NGINX_LISTEN|g" -e "s|^@SERVERS@$|$servers|" \
    "$template" > "$prefix/nginx.conf"
exec nginx -p "$prefix" -c "$prefix/nginx.conf" -g "daemon off;"
