#!/usr/bin/env bash
# Gathers freely licensed English text from Debian packages into one corpus file:
#   - the King James Bible (bible-kjv-text, read through the bible-kjv program), verse references
#     removed;
#   - the fortunes of the fortunes and fortunes-min packages (offensive ones are in another
#     package and not used), ASCII art left out.
#   tools/train/gather_text.sh OUT_FILE
set -euo pipefail
out="$1"
for p in bible-kjv bible-kjv-text fortunes fortunes-min; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
    { echo "gather_text: install $p" >&2; exit 1; }
done
{
  bible -f "Ge1:1-Re22:21" | sed -E 's/^[1-3]?[A-Za-z]+[0-9]+:[0-9]+ //'
  for f in /usr/share/games/fortunes/*; do
    case "$f" in *.dat|*.u8|*/ascii-art|*/art) continue ;; esac
    [ -f "$f" ] && cat "$f"
  done
} > "$out"
echo "gather_text: $(wc -c < "$out") bytes in $out" >&2
