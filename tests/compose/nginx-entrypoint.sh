#!/bin/sh
# Stand-in for the official nginx image's /docker-entrypoint.sh, the part compose.yaml uses
# (its 20-envsubst-on-templates.sh): each /etc/nginx/templates/NAME.template becomes
# /etc/nginx/conf.d/NAME with envsubst of the variables NGINX_ENVSUBST_FILTER matches, then
# the command runs.
set -eu
filter="${NGINX_ENVSUBST_FILTER:-}"
defined=$(printf '${%s} ' $(awk "END { for (name in ENVIRON) { print ( name ~ /${filter}/ ) ? name : \"\" } }" </dev/null))
for template in /etc/nginx/templates/*.template; do
  [ -e "$template" ] || continue
  out="/etc/nginx/conf.d/$(basename "$template" .template)"
  envsubst "$defined" <"$template" >"$out"
  echo "stand-in entrypoint: rendered $out" >&2
done
exec "$@"
