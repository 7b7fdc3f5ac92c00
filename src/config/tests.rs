//! Loading configs: defaults, every problem with its key path, and the normalised output.

use super::*;
use crate::destination::{Block, KeyFrom, VendorPace};
use crate::signals::{Families, Family};

fn parse(text: &str) -> Result<Config, Vec<ConfigProblem>> {
    Config::parse(text, Path::new("/nonexistent"))
}

fn paths(problems: &[ConfigProblem]) -> Vec<&str> {
    problems.iter().map(|p| p.path.as_str()).collect()
}

const MINIMAL: &str = "[tls]\ngenerate_ca = true\n";

#[test]
fn empty_config_gets_safe_defaults() {
    let c = parse(MINIMAL).unwrap();
    assert_eq!(c.proxy.listen.to_string(), "127.0.0.1:3128");
    assert_eq!(c.admin.listen.to_string(), "127.0.0.1:9464");
    assert_eq!(c.proxy.unmatched, Unmatched::Deny);
    assert!(!c.proxy.allow_private_upstreams);
    let cores = std::thread::available_parallelism().unwrap().get();
    assert_eq!(c.proxy.threads, cores);
    assert_eq!(
        parse(&format!("[proxy]\nthreads = 1\n{MINIMAL}"))
            .unwrap()
            .proxy
            .threads,
        1
    );
    assert_eq!(c.tls.ca_key, Path::new("/nonexistent/ca-key.pem"));
}

#[test]
fn reports_every_problem_with_its_key_path() {
    let err = parse(
        r#"
        [proxy]
        listen = "nowhere"
        colour = "blue"
        threads = 0
        [proxy.limits]
        header_read_timeout = "0s"
        [upstream]
        connect_timeout = "soon"
        [tls]
        generate_ca = true
        [destinations.img]
        hosts = ["img.example.com", "bad host"]
        rate = 5
        quota = [{ limit = 0, per = "1m" }]
        [destinations.cdn]
        hosts = ["*.example.com"]
        [classes]
        order = []
        "#,
    )
    .unwrap_err();
    let p = paths(&err);
    for expected in [
        "proxy.colour",
        "proxy.listen",
        "proxy.threads",
        "proxy.limits.header_read_timeout",
        "upstream.connect_timeout",
        "destinations.img.quota[0].limit",
        "destinations.img.hosts[1]",
        "destinations.img.hosts[0]",
        "destinations.cdn.rate",
        "classes.order",
    ] {
        assert!(p.contains(&expected), "missing {expected} in {err:#?}");
    }
}

#[test]
fn classes_and_quotas_are_read() {
    let c = parse(
        r#"
        [tls]
        generate_ca = true
        [classes]
        order = ["interactive", "scheduled", "backfill"]
        default = "scheduled"
        [classes.share]
        backfill = 0.1
        [classes.max_wait]
        interactive = "5s"
        [destinations.api]
        hosts = ["api.example.com"]
        rate = 10
        quota = [{ limit = 600, per = "1m" }, { limit = 20000, per = "1d" }]
        "#,
    )
    .unwrap();
    let interactive = c.classes.lookup("interactive").unwrap();
    assert_eq!(
        c.classes.max_wait(interactive),
        Some(Duration::from_secs(5))
    );
    assert_eq!(c.classes.default_class(), crate::class::Class(1));
    assert_eq!(c.classes.shares(), vec![0.0, 0.0, 0.1]);
    assert_eq!(c.destinations[0].pace.quota[1].limit, 20000);
    assert_eq!(
        c.destinations[0].pace.quota[1].per,
        Duration::from_secs(86400)
    );
    // The normalised output reads back the same.
    let again = Config::parse(&c.to_toml(), Path::new("/nonexistent")).unwrap();
    assert_eq!(again.classes, c.classes);
    assert_eq!(
        again.destinations[0].pace.quota,
        c.destinations[0].pace.quota
    );
    // Without [classes], one class named `default`, and none in the normalised output.
    let minimal = parse(MINIMAL).unwrap();
    assert_eq!(minimal.classes.order, ["default"]);
    assert!(!minimal.to_toml().contains("[classes]"));
}

#[test]
fn durations_must_be_strings_with_units() {
    let err = parse("[upstream]\nconnect_timeout = 5\n[tls]\ngenerate_ca = true").unwrap_err();
    assert_eq!(paths(&err), ["upstream.connect_timeout"]);
    let c = parse("[upstream]\nconnect_timeout = \"250ms\"\n[tls]\ngenerate_ca = true").unwrap();
    assert_eq!(c.upstream.connect_timeout, Duration::from_millis(250));
}

#[test]
fn missing_ca_without_generate_ca_is_an_error() {
    let err = parse("").unwrap_err();
    assert_eq!(paths(&err), ["tls.ca_cert", "tls.ca_key"]);
}

#[test]
fn auth_reads_password_from_environment() {
    std::env::set_var("PACEGATE_TEST_CONFIG_PW", "s3cret");
    let c = parse(
        "[proxy.auth]\nusers = [{ name = \"w\", password_env = \"PACEGATE_TEST_CONFIG_PW\" }]\n[tls]\ngenerate_ca = true",
    )
    .unwrap();
    let user = &c.proxy.auth.unwrap().users[0];
    assert_eq!(user.password_sha256, User::digest(b"s3cret"));
    assert!(!format!("{user:?}").contains("s3cret"));
    let err = parse("[proxy.auth]\nusers = [{ name = \"w\", password_env = \"PACEGATE_TEST_UNSET_VAR\" }]\n[tls]\ngenerate_ca = true")
        .unwrap_err();
    assert_eq!(paths(&err), ["proxy.auth.users[0].password_env"]);
}

#[test]
fn normalised_output_parses_back() {
    let c = parse(
        "[destinations.a]\nhosts = [\"A.example.com:443\"]\nrate = 0.5\nmax_wait = \"2s\"\n[tls]\ngenerate_ca = true",
    )
    .unwrap();
    let text = c.to_toml();
    assert!(text.contains("a.example.com:443"), "{text}");
    let again = parse(&text).unwrap();
    assert_eq!(again.destinations[0].hosts, c.destinations[0].hosts);
    assert_eq!(again.destinations[0].pace, c.destinations[0].pace);
    assert_eq!(again.destinations[0].pace.max_wait, Duration::from_secs(2));
}

#[test]
fn syntax_errors_are_reported() {
    let err = parse("[proxy\nlisten=").unwrap_err();
    assert_eq!(paths(&err), ["(file)"]);
}

#[test]
fn vendor_signal_keys_are_read_and_round_trip() {
    let c = parse(
        r#"
        [tls]
        generate_ca = true
        [destinations.github]
        hosts = ["api.github.com"]
        rate = 10
        signals = ["ietf", "x-ratelimit"]
        reserve = 50
        vendor_pace = "spread"
        throttle_block = { min = "60s", max = "1h", jitter = 0.2 }
        throttle_body = ["Secondary Rate Limit"]
        [destinations.github.groups.search]
        paths = ["/search/*"]
        [destinations.plain]
        hosts = ["plain.example.com"]
        rate = 1
        "#,
    )
    .unwrap();
    let github = &c.destinations[0].pace;
    assert_eq!(
        github.signals,
        Families::of(&[Family::Ietf, Family::XRateLimit])
    );
    assert_eq!(github.reserve, 50);
    assert_eq!(github.vendor_pace, VendorPace::Spread);
    assert_eq!(
        c.destinations[0].groups[0].pace.vendor_pace,
        VendorPace::Spread,
        "a group inherits it"
    );
    assert_eq!(
        github.throttle_block,
        Some(Block {
            min: Duration::from_secs(60),
            max: Duration::from_secs(3600),
            jitter: 0.2
        })
    );
    assert_eq!(
        github.throttle_body,
        ["secondary rate limit"],
        "markers compare lower-case"
    );
    let plain = &c.destinations[1].pace;
    assert_eq!(plain.signals, Families::ALL);
    assert_eq!((plain.reserve, plain.throttle_block), (0, None));
    assert_eq!(plain.vendor_pace, VendorPace::Burst, "the default");
    assert_eq!(plain.throttle_body, ["rate limit", "too many requests"]);
    let again = Config::parse(&c.to_toml(), Path::new("/nonexistent")).unwrap();
    assert_eq!(again.destinations[0].pace, c.destinations[0].pace);
    assert_eq!(again.destinations[1].pace, c.destinations[1].pace);
}

#[test]
fn vendor_signal_keys_are_checked() {
    let err = parse(
        r#"
        [tls]
        generate_ca = true
        [destinations.a]
        hosts = ["a.example.com"]
        rate = 1
        signals = "sometimes"
        throttle_block = { max = "1s", jitter = 1.5 }
        throttle_body = [""]
        [destinations.b]
        hosts = ["b.example.com"]
        rate = 1
        signals = ["ietf", "github"]
        throttle_block = { min = "2m", max = "1m" }
        [destinations.c]
        hosts = ["c.example.com"]
        rate = 1
        reserve = -1
        vendor_pace = "drip"
        "#,
    )
    .unwrap_err();
    let p = paths(&err);
    for expected in [
        "destinations.a.signals",
        "destinations.a.throttle_block.min",
        "destinations.a.throttle_block.jitter",
        "destinations.a.throttle_body[0]",
        "destinations.b.signals[1]",
        "destinations.b.throttle_block.max",
        "destinations.c.reserve",
        "destinations.c.vendor_pace",
    ] {
        assert!(p.contains(&expected), "missing {expected} in {err:#?}");
    }
    let github = err
        .iter()
        .find(|e| e.path == "destinations.b.signals[1]")
        .unwrap();
    assert!(github.message.contains("x-ratelimit"), "{github:?}");
}

#[test]
fn values_that_would_break_the_arithmetic_are_refused() {
    let err = parse(
        r#"
        [tls]
        generate_ca = true
        [destinations.a]
        hosts = ["a.example.com"]
        rate = 1e-20
        backoff_max = 1e9
        retry_after_max = "30d"
        throttle_block = { min = "1s", max = "8d" }
        "#,
    )
    .unwrap_err();
    let p = paths(&err);
    for expected in [
        "destinations.a.rate",
        "destinations.a.backoff_max",
        "destinations.a.retry_after_max",
        "destinations.a.throttle_block.max",
    ] {
        assert!(p.contains(&expected), "missing {expected} in {err:#?}");
    }
    // At the bounds, accepted.
    parse(
        r#"
        [tls]
        generate_ca = true
        [destinations.a]
        hosts = ["a.example.com"]
        rate = 0.001
        backoff_max = 10000
        retry_after_max = "7d"
        "#,
    )
    .unwrap();
}

#[test]
fn an_admin_listener_beyond_loopback_needs_a_token() {
    let text = |admin: &str| format!("[tls]\ngenerate_ca = true\n[admin]\n{admin}\n");
    let err = parse(&text("listen = \"0.0.0.0:9464\"")).unwrap_err();
    let problem = err
        .iter()
        .find(|e| e.path == "admin.listen")
        .expect("refused");
    assert!(problem.message.contains("token_env"), "{problem:?}");
    std::env::set_var("PACEGATE_CONFIG_TEST_TOKEN", "t0ken");
    parse(&text(
        "listen = \"0.0.0.0:9464\"\ntoken_env = \"PACEGATE_CONFIG_TEST_TOKEN\"",
    ))
    .unwrap();
    parse(&text("listen = \"[::1]:9464\"")).unwrap();
}

#[test]
fn a_users_classes_must_be_configured_classes() {
    let err = parse(
        r#"
        [tls]
        generate_ca = true
        [proxy.auth]
        users = [{ name = "w", password_sha256 = "30c952fab122c3f9759f02a6d95c3758b246b4fee239957b2d4fee46e26170c4", classes = ["backfill", "urgent"] }]
        [classes]
        order = ["interactive", "backfill"]
        default = "backfill"
        "#,
    )
    .unwrap_err();
    assert_eq!(paths(&err), ["proxy.auth.users[0].classes[1]"], "{err:#?}");
}

#[test]
fn an_empty_or_dotted_key_is_named_quoted() {
    let problems = parse("\"\" = \"\"\n\"a.b\" = 1\n[proxy]\n\"\" = 1\n").unwrap_err();
    let paths = paths(&problems);
    assert!(paths.contains(&"\"\""), "{paths:?}");
    assert!(paths.contains(&"\"a.b\""), "{paths:?}");
    assert!(paths.contains(&"proxy.\"\""), "{paths:?}");
}

#[test]
fn a_parent_proxy_is_read_with_its_credentials_and_shown_without_its_password() {
    let c = parse(&format!(
        "{MINIMAL}[upstream]\nproxy = \"http://corp%40x:p%3Ass@proxy.corp:3128\"\nno_proxy = [\"*.internal\", \"10.0.0.5\"]\n"
    ))
    .unwrap();
    let parent = c.upstream.proxy.as_ref().unwrap();
    assert_eq!((parent.host.as_str(), parent.port), ("proxy.corp", 3128));
    // base64("corp@x:p:ss")
    assert_eq!(
        parent.authorization.as_deref(),
        Some("Basic Y29ycEB4OnA6c3M=")
    );
    assert_eq!(c.upstream.no_proxy.len(), 2);
    let shown = c.to_toml();
    assert!(
        shown.contains("proxy = \"http://corp@x:****@proxy.corp:3128\""),
        "{shown}"
    );
    assert!(
        !shown.contains("p:ss") && !shown.contains("p%3Ass"),
        "{shown}"
    );

    let err = parse(&format!(
        "{MINIMAL}[upstream]\nproxy = \"https://proxy.corp:3128\"\nno_proxy = [\"*\"]\n"
    ))
    .unwrap_err();
    assert_eq!(paths(&err), ["upstream.proxy", "upstream.no_proxy[0]"]);
    let err = parse(&format!(
        "{MINIMAL}[upstream]\nproxy = \"http://proxy.corp:3128/path\"\n"
    ))
    .unwrap_err();
    assert_eq!(paths(&err), ["upstream.proxy"]);
    let err = parse(&format!(
        "{MINIMAL}[upstream]\nno_proxy = [\"a.example\"]\n"
    ))
    .unwrap_err();
    assert!(err[0].message.contains("without upstream.proxy"), "{err:?}");
}

#[test]
fn one_bad_value_hides_no_other_problem_of_its_section() {
    let err = parse(
        r#"
        [proxy]
        unmatched = "maybe"
        listen = "nowhere"
        threads = 0
        shutdown_grace = "2h"
        [proxy.limits]
        max_connections = 0
        idle_timeout = "soon"
        write_timeout = "300000000000y"
        [tls]
        generate_ca = true
        [destinations.a]
        hosts = ["a.example.com"]
        rate = "fast"
        burst = 0
        max_wait = "300000000000y"
        "#,
    )
    .unwrap_err();
    let mut p = paths(&err);
    p.sort_unstable();
    assert_eq!(
        p,
        vec![
            "destinations.a.burst",
            "destinations.a.max_wait",
            "destinations.a.rate",
            "proxy.limits.idle_timeout",
            "proxy.limits.max_connections",
            "proxy.limits.write_timeout",
            "proxy.listen",
            "proxy.shutdown_grace",
            "proxy.threads",
            "proxy.unmatched",
        ],
        "each key once: {err:#?}"
    );
}

#[test]
fn every_duration_and_count_has_an_upper_bound() {
    let huge = "\"300000000000y\"";
    for (section, key, value) in [
        ("proxy", "shutdown_grace", huge),
        ("proxy.limits", "header_read_timeout", huge),
        ("proxy.limits", "idle_timeout", huge),
        ("proxy.limits", "ping_interval", huge),
        ("proxy.limits", "ping_timeout", huge),
        ("proxy.limits", "write_timeout", huge),
        ("proxy.limits", "handshake_timeout", huge),
        ("proxy.limits", "tunnel_idle_timeout", huge),
        ("proxy.limits", "max_connections", "9223372036854775807"),
        ("proxy.limits", "max_requests", "9223372036854775807"),
        ("proxy.limits", "max_streams", "4294967295"),
        ("upstream", "connect_timeout", huge),
        ("upstream", "response_timeout", huge),
        ("upstream", "pool_idle_timeout", huge),
        ("upstream", "pool_max_idle_per_host", "9223372036854775807"),
        ("tls", "leaf_validity", huge),
        ("classes.max_wait", "a", huge),
        ("destinations.d", "max_wait", huge),
        ("destinations.d", "burst", "4294967295"),
        ("destinations.d", "max_concurrency", "9223372036854775807"),
        ("destinations.d", "decay_after", "4294967295"),
        ("destinations.d", "retry_throttled", "4294967295"),
        ("destinations.d", "reserve", "4294967295"),
        ("destinations.d", "max_keys", "9223372036854775807"),
        ("destinations.d", "key_idle", huge),
    ] {
        let text = format!(
            "[tls]\ngenerate_ca = true\n[classes]\norder = [\"a\"]\ndefault = \"a\"\n[destinations.d]\nhosts = [\"d.example\"]\nrate = 1\n[{section}]\n{key} = {value}\n"
        );
        // A section may already be open above: TOML refuses it twice, so merge by hand.
        let text = dedupe_sections(&text);
        let err = parse(&text).expect_err(&format!("{section}.{key} = {value} was accepted"));
        let path = format!("{section}.{key}");
        assert_eq!(paths(&err), vec![path.as_str()], "{err:#?}");
    }
    let err = parse(&format!(
        "{MINIMAL}[destinations.d]\nhosts = [\"d.example\"]\nrate = 1\nquota = [{{ limit = 5, per = {huge} }}]\n"
    ))
    .unwrap_err();
    assert_eq!(paths(&err), vec!["destinations.d.quota[0].per"]);
}

/// Joins a TOML text's repeated `[section]` headers into the first of each.
fn dedupe_sections(text: &str) -> String {
    let mut sections: Vec<(String, Vec<String>)> = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            current = name.to_owned();
            if !sections.iter().any(|(n, _)| *n == current) {
                sections.push((current.clone(), Vec::new()));
            }
            continue;
        }
        if let Some((_, lines)) = sections.iter_mut().find(|(n, _)| *n == current) {
            lines.push(line.to_owned());
        }
    }
    sections
        .into_iter()
        .map(|(name, lines)| format!("[{name}]\n{}\n", lines.join("\n")))
        .collect()
}

#[test]
fn listening_beyond_loopback_needs_auth_or_a_client_list() {
    let err = parse(&format!("[proxy]\nlisten = \"0.0.0.0:3128\"\n{MINIMAL}")).unwrap_err();
    assert_eq!(paths(&err), vec!["proxy.listen"], "{err:#?}");
    assert!(err[0].message.contains("clients"), "{err:#?}");
    let listed = parse(&format!(
        "[proxy]\nlisten = \"0.0.0.0:3128\"\nclients = [\"10.0.0.0/8\", \"192.168.1.7\", \"fd00::/8\", \"10.1.2.3/16\"]\n{MINIMAL}"
    ))
    .unwrap();
    let shown: Vec<String> = listed
        .proxy
        .clients
        .unwrap()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        shown,
        ["10.0.0.0/8", "192.168.1.7/32", "fd00::/8", "10.1.0.0/16"]
    );
    std::env::set_var("PACEGATE_TEST_BEYOND_PW", "pw");
    parse(&format!(
        "[proxy]\nlisten = \"0.0.0.0:3128\"\n[proxy.auth]\nusers = [{{ name = \"w\", password_env = \"PACEGATE_TEST_BEYOND_PW\" }}]\n{MINIMAL}"
    ))
    .unwrap();
    let err = parse(&format!(
        "[proxy]\nclients = [\"10.0.0.0/33\", \"everyone\"]\n{MINIMAL}"
    ))
    .unwrap_err();
    assert_eq!(
        paths(&err),
        vec!["proxy.clients[0]", "proxy.clients[1]"],
        "{err:#?}"
    );
}

#[test]
fn a_group_takes_its_own_keys_and_inherits_the_rest() {
    let c = parse(&format!(
        r#"{MINIMAL}
        [destinations.github]
        hosts = ["api.github.com"]
        rate = 20
        max_wait = "30s"
        quota = [{{ limit = 5000, per = "1h" }}]
        [destinations.github.groups.search]
        paths = ["/search/"]
        resource = "search"
        rate = 0.5
        [destinations.github.groups.writes]
        methods = ["post", "PATCH"]
        "#
    ))
    .unwrap();
    let d = &c.destinations[0];
    assert_eq!(d.pace.rate, 20.0);
    let search = &d.groups[0];
    assert_eq!(search.name, "search");
    assert_eq!(search.paths, vec!["/search/"]);
    assert_eq!(search.resource.as_deref(), Some("search"));
    assert_eq!(search.pace.rate, 0.5);
    // What the group does not set, it inherits.
    assert_eq!(search.pace.max_wait, Duration::from_secs(30));
    assert_eq!(search.pace.quota, d.pace.quota);
    let writes = &d.groups[1];
    assert_eq!(writes.methods, vec!["POST", "PATCH"]);
    assert_eq!(writes.pace.rate, 20.0);
}

#[test]
fn group_mistakes_are_reported_with_their_key_paths() {
    let err = parse(&format!(
        r#"{MINIMAL}
        [destinations.github]
        hosts = ["api.github.com"]
        rate = 20
        paths = ["/search/"]
        [destinations.github.groups.search]
        paths = ["search/"]
        hosts = ["other.example"]
        intercept = false
        rate = -1
        [destinations.github.groups.empty]
        resource = "core"
        [destinations.github.groups."bad name"]
        methods = ["GET"]
        [destinations.github.groups.verbs]
        methods = ["GE T"]
        colour = "blue"
        "#
    ))
    .unwrap_err();
    let mut got = paths(&err);
    got.sort_unstable();
    assert_eq!(
        got,
        vec![
            "destinations.github.groups.bad name",
            "destinations.github.groups.empty",
            "destinations.github.groups.search.hosts",
            "destinations.github.groups.search.intercept",
            "destinations.github.groups.search.paths[0]",
            "destinations.github.groups.search.rate",
            "destinations.github.groups.verbs.colour",
            "destinations.github.groups.verbs.methods[0]",
            "destinations.github.paths",
        ],
        "{err:#?}"
    );
}

#[test]
fn keys_are_read_inherited_and_checked() {
    let c = parse(&format!(
        r#"{MINIMAL}
        [destinations.github]
        hosts = ["api.github.com"]
        rate = 20
        key = "header:Authorization"
        max_keys = 500
        total_rate = 60
        [destinations.github.groups.search]
        paths = ["/search/"]
        rate = 0.5
        key_idle = "1h"
        [destinations.crawl]
        hosts = ["*.example.org"]
        rate = 2
        key = "host"
        [destinations.tenants]
        hosts = ["api.example.net"]
        rate = 2
        key = "proxy-user"
        "#
    ))
    .unwrap();
    let by = |name: &str| c.destinations.iter().find(|d| d.name == name).unwrap();
    let github = by("github");
    let header = KeyFrom::Header(http::HeaderName::from_static("authorization"));
    assert_eq!(github.pace.key.as_ref(), Some(&header));
    assert_eq!(
        (github.pace.max_keys, github.pace.key_idle),
        (500, Duration::from_secs(600))
    );
    assert_eq!(github.pace.total_rate, Some(60.0));
    let search = &github.groups[0].pace;
    assert_eq!(search.key.as_ref(), Some(&header), "inherited");
    assert_eq!(
        (search.max_keys, search.key_idle),
        (500, Duration::from_secs(3600))
    );
    assert_eq!(by("crawl").pace.key, Some(KeyFrom::Host));
    assert!(!KeyFrom::Host.is_credential());
    assert_eq!(by("tenants").pace.key, Some(KeyFrom::ProxyUser));
    assert!(KeyFrom::ProxyUser.is_credential());

    let err = parse(&format!(
        r#"{MINIMAL}
        [destinations.a]
        hosts = ["a.example"]
        rate = 1
        key = "cookie"
        [destinations.b]
        hosts = ["b.example"]
        rate = 1
        key = "header:bad name"
        max_keys = 0
        [destinations.c]
        hosts = ["c.example"]
        rate = 0.1
        key = "host"
        key_idle = "5s"
        [destinations.d]
        hosts = ["d.example"]
        rate = 10
        key = "host"
        key_idle = "1m"
        quota = [{{ limit = 100, per = "1h" }}]
        [destinations.e]
        hosts = ["e.example"]
        rate = 1
        total_rate = 5
        [destinations.f]
        hosts = ["f.example"]
        rate = 1
        key = "host"
        total_rate = 0
        "#
    ))
    .unwrap_err();
    let mut got = paths(&err);
    got.sort_unstable();
    assert_eq!(
        got,
        [
            "destinations.a.key",
            "destinations.b.key",
            "destinations.b.max_keys",
            "destinations.c.key_idle",
            "destinations.d.key_idle",
            "destinations.e.total_rate",
            "destinations.f.total_rate",
        ],
        "{err:#?}"
    );
    let text = format!("{err:?}");
    assert!(
        text.contains("header:NAME") && text.contains("start afresh"),
        "{text}"
    );
}

#[test]
fn a_key_on_a_header_taken_off_before_keying_is_refused_with_the_alternative() {
    for (key, says) in [
        ("header:proxy-authorization", "write \\\"proxy-user"),
        ("header:Proxy-Authorization", "write \\\"proxy-user"),
        ("header:pacegate-class", "taken off every request"),
        ("header:connection", "taken off every request"),
        ("header:te", "taken off every request"),
        ("header:upgrade", "taken off every request"),
        ("header:transfer-encoding", "taken off every request"),
    ] {
        let err = parse(&format!(
            "{MINIMAL}\n[destinations.a]\nhosts = [\"a.example\"]\nrate = 1\nkey = \"{key}\"\n"
        ))
        .unwrap_err();
        assert_eq!(paths(&err), ["destinations.a.key"], "{key}");
        let text = format!("{err:?}");
        assert!(
            text.contains(says) && text.contains("empty key"),
            "{key}: {text}"
        );
    }
}

#[test]
fn values_that_would_make_the_proxy_unusable_are_refused() {
    let err = parse(&format!(
        r#"{MINIMAL}
        [proxy.limits]
        ping_interval = "1ns"
        header_read_timeout = "1ns"
        write_timeout = "99ms"
        [destinations.a]
        hosts = ["a.example"]
        rate = 1
        throttle_statuses = [200, 429]
        lockout_statuses = [100, 302, 403]
        "#
    ))
    .unwrap_err();
    let mut got = paths(&err);
    got.sort_unstable();
    assert_eq!(
        got,
        [
            "destinations.a.lockout_statuses[0]",
            "destinations.a.lockout_statuses[1]",
            "destinations.a.throttle_statuses[0]",
            "proxy.limits.header_read_timeout",
            "proxy.limits.ping_interval",
            "proxy.limits.write_timeout",
        ],
        "{err:#?}"
    );
    let text = format!("{err:?}");
    assert!(
        text.contains("not an error status") && text.contains("at least 100ms"),
        "{text}"
    );
    // The shortest allowed are taken.
    let c = parse(&format!(
        "{MINIMAL}\n[proxy.limits]\nping_interval = \"100ms\"\n[destinations.a]\nhosts = [\"a.example\"]\nrate = 1\nthrottle_statuses = [400, 599]\n"
    ))
    .unwrap();
    assert_eq!(c.proxy.limits.ping_interval, Duration::from_millis(100));
}

#[test]
fn a_client_s_share_of_the_keys_defaults_to_half_and_stays_within_max_keys() {
    let c = parse(&format!(
        "{MINIMAL}\n[destinations.a]\nhosts = [\"a.example\"]\nrate = 1\nkey = \"host\"\nmax_keys = 1001\n[destinations.b]\nhosts = [\"b.example\"]\nrate = 1\nkey = \"host\"\nmax_keys_per_client = 7\n"
    ))
    .unwrap();
    let by = |name: &str| c.destinations.iter().find(|d| d.name == name).unwrap();
    assert_eq!(by("a").pace.max_keys_per_client, 500);
    assert_eq!(by("b").pace.max_keys_per_client, 7);
    // Never under 100, or all of them where fewer.
    for (max_keys, share) in [(150, 100), (2, 2), (100, 100), (10_000, 5_000)] {
        let c = parse(&format!(
            "{MINIMAL}\n[destinations.a]\nhosts = [\"a.example\"]\nrate = 1\nkey = \"host\"\nmax_keys = {max_keys}\n"
        ))
        .unwrap();
        assert_eq!(
            c.destinations[0].pace.max_keys_per_client, share,
            "{max_keys}"
        );
    }
    let err = parse(&format!(
        "{MINIMAL}\n[destinations.a]\nhosts = [\"a.example\"]\nrate = 1\nkey = \"host\"\nmax_keys = 10\nmax_keys_per_client = 11\n"
    ))
    .unwrap_err();
    assert_eq!(paths(&err), ["destinations.a.max_keys_per_client"]);
}

#[test]
fn meters_are_read_in_their_units_with_the_destination_s_keys() {
    let c = parse(&format!(
        r#"{MINIMAL}
        [destinations.openai]
        hosts = ["api.openai.com"]
        rate = 50
        max_wait = "2m"
        max_body = "1MiB"
        [destinations.openai.meters.tokens]
        per_minute = 90000
        cost = "openai"
        [destinations.shop]
        hosts = ["shop.example.com"]
        rate = 10
        [destinations.shop.meters.points]
        rate = 50
        cost = "shopify-graphql"
        default = 100000
        "#
    ))
    .unwrap();
    let openai = &c.destinations[0];
    assert_eq!(openai.max_body, 1024 * 1024);
    let tokens = &openai.meters[0];
    assert_eq!(tokens.name, "tokens");
    assert_eq!(tokens.cost, crate::meter::Cost::OpenAi);
    assert_eq!(tokens.size, 90_000);
    assert_eq!(tokens.default, 1024);
    assert_eq!(tokens.pace.rate, 1500.0);
    assert_eq!(tokens.pace.burst, 1);
    assert_eq!(tokens.pace.max_wait, Duration::from_secs(120));
    let shop = &c.destinations[1];
    assert_eq!(shop.max_body, crate::destination::DEFAULT_MAX_BODY);
    let points = &shop.meters[0];
    assert_eq!(points.pace.rate, 50.0);
    // A default is never more than the meter allows in a minute.
    assert_eq!((points.size, points.default), (3000, 3000));
}

#[test]
fn a_meter_s_quota_windows_are_in_its_unit_and_bound_its_largest_estimate() {
    let c = parse(&format!(
        r#"{MINIMAL}
        [destinations.openai]
        hosts = ["api.openai.com"]
        rate = 50
        [destinations.openai.meters.tokens]
        per_minute = 90000
        cost = "openai"
        quota = [{{ limit = 2000000, per = "1d" }}, {{ limit = 60000, per = "1m" }}]
        "#
    ))
    .unwrap();
    let tokens = &c.destinations[0].meters[0];
    assert_eq!(
        tokens
            .pace
            .quota
            .iter()
            .map(|q| q.limit)
            .collect::<Vec<_>>(),
        [2_000_000, 60_000]
    );
    // No request is estimated above what its smallest window holds, or it could never fit.
    assert_eq!(tokens.size, 60_000);
    // A meter split by key needs its keys kept as long as its longest window.
    let err = parse(&format!(
        r#"{MINIMAL}
        [destinations.openai]
        hosts = ["api.openai.com"]
        rate = 50
        key = "json:model"
        [destinations.openai.meters.tokens]
        per_minute = 90000
        cost = "openai"
        quota = [{{ limit = 2000000, per = "1d" }}, {{ limit = 5, per = "0s" }}]
        "#
    ))
    .unwrap_err();
    let mut got = paths(&err);
    got.sort_unstable();
    assert_eq!(
        got,
        [
            "destinations.openai.meters.tokens.quota",
            "destinations.openai.meters.tokens.quota[1].per"
        ],
        "{err:#?}"
    );
    assert!(
        format!("{err:?}").contains("raise `key_idle` to at least 1day"),
        "{err:#?}"
    );
}

#[test]
fn a_meter_keeps_a_window_as_long_as_it_was_given() {
    let c = parse(&format!(
        r#"{MINIMAL}
        [destinations.llm]
        hosts = ["api.example.com"]
        rate = 50
        [destinations.llm.meters.tokens]
        per_minute = 90000
        cost = "openai"
        [destinations.llm.meters.output]
        rate = 1500.5
        cost = "anthropic-output"
        [destinations.llm.meters.points]
        rate = 0.5
        cost = 1
        "#
    ))
    .unwrap();
    let window = |unit: &str| {
        let m = c.destinations[0].meters.iter().find(|m| m.name == unit);
        m.and_then(|m| m.pace.window)
            .map(|w| (w.limit, w.per.as_secs()))
    };
    // A minute for `per_minute`; a second for a `rate` (its whole units), but a minute for
    // one under a unit a second, whose second would hold nothing.
    assert_eq!(window("tokens"), Some((90_000, 60)));
    assert_eq!(window("output"), Some((1_500, 1)));
    assert_eq!(window("points"), Some((30, 60)));
    // A request budget keeps none.
    assert_eq!(c.destinations[0].pace.window, None);
}

#[test]
fn meter_mistakes_are_reported_with_their_key_paths() {
    let err = parse(&format!(
        r#"{MINIMAL}
        [destinations.openai]
        hosts = ["api.openai.com"]
        rate = 50
        max_body = "a lot"
        [destinations.openai.meters.tokens]
        per_minute = 90000
        rate = 1500
        cost = "openai"
        [destinations.openai.meters.none]
        cost = "by the word"
        [destinations.openai.meters.free]
        per_minute = 0
        cost = 0
        default = 0
        colour = "blue"
        [destinations.openai.groups.chat]
        paths = ["/v1/chat/"]
        [destinations.openai.groups.chat.meters.tokens]
        per_minute = 0
        cost = "openai"
        quota = [{{ limit = 0, per = "1d" }}]
        "#
    ))
    .unwrap_err();
    let mut got = paths(&err);
    got.sort_unstable();
    assert_eq!(
        got,
        vec![
            "destinations.openai.groups.chat.meters.tokens.per_minute",
            "destinations.openai.groups.chat.meters.tokens.quota[0].limit",
            "destinations.openai.max_body",
            "destinations.openai.meters.free.colour",
            "destinations.openai.meters.free.cost",
            "destinations.openai.meters.free.default",
            "destinations.openai.meters.free.per_minute",
            "destinations.openai.meters.none",
            "destinations.openai.meters.none.cost",
            "destinations.openai.meters.tokens",
        ],
        "{err:#?}"
    );
}

#[test]
fn the_cache_section_is_read_checked_and_needed_by_a_collapsing_destination() {
    let c = parse(
        r#"
        [tls]
        generate_ca = true
        [cache]
        memory = "64MiB"
        lead_timeout = "2s"
        [destinations.images]
        hosts = ["images.example.com"]
        rate = 7
        cache = true
        "#,
    )
    .unwrap();
    let cache = c.cache.as_ref().unwrap();
    assert_eq!(cache.memory, 64 * 1024 * 1024);
    assert_eq!(cache.max_object, 32 * 1024 * 1024, "the default");
    assert_eq!(cache.lead_timeout, Duration::from_secs(2));
    assert!(c.destinations[0].pace.cache);
    let again = Config::parse(&c.to_toml(), Path::new("/nonexistent")).unwrap();
    assert_eq!(again.cache, c.cache);
    let err = parse(
        r#"
        [tls]
        generate_ca = true
        [destinations.images]
        hosts = ["images.example.com"]
        rate = 7
        cache = true
        "#,
    )
    .unwrap_err();
    assert_eq!(paths(&err), ["destinations.images.cache"], "{err:#?}");
    let with_disk = parse(
        r#"
        [tls]
        generate_ca = true
        [cache]
        memory = "64MiB"
        dir = "/var/cache/pacegate"
        "#,
    )
    .unwrap();
    let cache = with_disk.cache.as_ref().unwrap();
    assert_eq!(cache.dir.as_deref(), Some(Path::new("/var/cache/pacegate")));
    assert_eq!(
        cache.disk,
        Some(10 * 1024 * 1024 * 1024),
        "the default with dir"
    );
    let again = Config::parse(&with_disk.to_toml(), Path::new("/nonexistent")).unwrap();
    assert_eq!(again.cache, with_disk.cache);
    let err = parse(
        r#"
        [tls]
        generate_ca = true
        [cache]
        memory = "1MiB"
        max_object = "2MiB"
        disk = "10GiB"
        lead_timeout = "1h"
        "#,
    )
    .unwrap_err();
    let p = paths(&err);
    for expected in ["cache.max_object", "cache.disk", "cache.lead_timeout"] {
        assert!(p.contains(&expected), "missing {expected} in {err:#?}");
    }
}
