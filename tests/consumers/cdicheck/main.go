// cdicheck loads CDI spec files with the CDI library podman links (0.5.x, the version Debian 12
// ships), the way podman does, and reports what that library makes of them as JSON.
//
// Usage: cdicheck SPEC_DIR [QUALIFIED_NAME...]
//
// The cache reads SPEC_DIR only (never /etc/cdi or /var/run/cdi unless that is the dir given)
// and is refreshed once, by hand: no directory watch. Every error the library records for a
// spec file is reported under that file's path; a file with an error contributes no devices,
// which is what makes podman answer "unresolvable CDI devices". With names, they are injected
// into an empty OCI spec as podman injects `--device` names, and the device nodes the library
// would give the runtime (type, major and minor filled in from the host; file mode, uid and
// gid as the spec and the process give them) are reported.
//
// Exit status: 0 when every spec file loads and every name resolves and injects; 1 otherwise;
// 2 for a usage error (including a SPEC_DIR that is not a directory: the library would skip a
// missing dir silently, and a check over nothing must not pass).
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/container-orchestrated-devices/container-device-interface/pkg/cdi"
	oci "github.com/opencontainers/runtime-spec/specs-go"
)

type specReport struct {
	Kind       string   `json:"kind"`
	CdiVersion string   `json:"cdiVersion"`
	Devices    []string `json:"devices"`
}

// What the runtime gets for a node; FileMode, UID and GID are null where the library leaves
// them to the runtime (runc then creates the node 0666, owned by 0:0).
type deviceNode struct {
	Path     string  `json:"path"`
	Type     string  `json:"type"`
	Major    int64   `json:"major"`
	Minor    int64   `json:"minor"`
	FileMode *uint32 `json:"fileMode"`
	UID      *uint32 `json:"uid"`
	GID      *uint32 `json:"gid"`
}

func permissionBits(mode *os.FileMode) *uint32 {
	if mode == nil {
		return nil
	}
	bits := uint32(mode.Perm())
	return &bits
}

type report struct {
	SpecDir     string                `json:"spec_dir"`
	Errors      map[string][]string   `json:"errors"`
	Specs       map[string]specReport `json:"specs"`
	Devices     []string              `json:"devices"`
	Requested   []string              `json:"requested"`
	Unresolved  []string              `json:"unresolved"`
	InjectError string                `json:"inject_error"`
	Injected    []deviceNode          `json:"injected_device_nodes"`
	Env         []string              `json:"injected_env"`
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: cdicheck SPEC_DIR [QUALIFIED_NAME...]")
		os.Exit(2)
	}
	dir, names := os.Args[1], os.Args[2:]
	if info, err := os.Stat(dir); err != nil || !info.IsDir() {
		fmt.Fprintf(os.Stderr, "cdicheck: %s is not a directory\n", dir)
		os.Exit(2)
	}

	cache, err := cdi.NewCache(cdi.WithSpecDirs(dir), cdi.WithAutoRefresh(false))
	if err != nil {
		fmt.Fprintf(os.Stderr, "cdicheck: %v\n", err)
		os.Exit(2)
	}
	// NewCache has refreshed once already; podman refreshes again before injecting and so do
	// we, so that what is reported is what a fresh `podman run` would see.
	_ = cache.Refresh() // its error repeats what GetErrors reports per file

	out := report{
		SpecDir:    dir,
		Errors:     map[string][]string{},
		Specs:      map[string]specReport{},
		Devices:    cache.ListDevices(),
		Requested:  names,
		Unresolved: []string{},
		Injected:   []deviceNode{},
		Env:        []string{},
	}
	if out.Devices == nil {
		out.Devices = []string{}
	}
	for path, errs := range cache.GetErrors() {
		for _, e := range errs {
			out.Errors[path] = append(out.Errors[path], e.Error())
		}
	}
	for _, vendor := range cache.ListVendors() {
		for _, spec := range cache.GetVendorSpecs(vendor) {
			devices := []string{}
			for _, d := range spec.Devices {
				devices = append(devices, d.Name)
			}
			sort.Strings(devices)
			out.Specs[spec.GetPath()] = specReport{spec.Kind, spec.Version, devices}
		}
	}

	failed := len(out.Errors) > 0
	if len(names) > 0 {
		// An empty OCI spec with a process, as podman's generated spec always has one (the
		// library copies the process's uid/gid onto injected nodes).
		ociSpec := &oci.Spec{Process: &oci.Process{}}
		unresolved, err := cache.InjectDevices(ociSpec, names...)
		if unresolved != nil {
			out.Unresolved = unresolved
		}
		if err != nil {
			out.InjectError = err.Error()
			failed = true
		}
		if ociSpec.Linux != nil {
			for _, d := range ociSpec.Linux.Devices {
				out.Injected = append(out.Injected, deviceNode{
					d.Path, d.Type, d.Major, d.Minor, permissionBits(d.FileMode), d.UID, d.GID,
				})
			}
		}
		if ociSpec.Process.Env != nil {
			out.Env = ociSpec.Process.Env
		}
	}

	encoder := json.NewEncoder(os.Stdout)
	encoder.SetIndent("", "  ")
	if err := encoder.Encode(out); err != nil {
		fmt.Fprintf(os.Stderr, "cdicheck: %v\n", err)
		os.Exit(2)
	}
	if failed {
		os.Exit(1)
	}
}
