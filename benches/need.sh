# Sourced by bench scripts: `need SCRIPT COMMAND:PACKAGE ...` installs the packages whose
# command is missing (as root on Debian), or says what SCRIPT needs and exits.
need() {
    local script=$1 pair missing=()
    shift
    for pair in "$@"; do
        command -v "${pair%%:*}" >/dev/null || [ -x "/usr/sbin/${pair%%:*}" ] || missing+=("${pair#*:}")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "$script: needs ${missing[*]} (apt-get install ${missing[*]})" >&2
        exit 1
    fi
}
