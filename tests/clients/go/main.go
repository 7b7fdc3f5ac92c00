// One GET through the proxies of the environment (HTTP_PROXY, HTTPS_PROXY, NO_PROXY), as a
// Go worker on net/http's default transport (ProxyFromEnvironment). Prints the status and
// the X-Up header.
package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
)

func main() {
	resp, err := http.Get(os.Getenv("TARGET"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println(resp.StatusCode, resp.Header.Get("X-Up"))
}
