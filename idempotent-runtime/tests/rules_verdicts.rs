//! The runtime's side of the shared verdict table
//! (`idempotent-macros/rules/tests/verdicts.toml`): every duration and
//! manifest case goes through the `idempotent` command line (`scopes
//! --manifest FILE`) and the runtime's manifest functions, and must get the
//! verdict written in the table. The macro's unit tests read the same table
//! through the macro's validation entry point, so the two cannot drift.
#![cfg(feature = "cli")]

use idempotent_runtime::cli::run_from;
use idempotent_runtime::manifest::Manifest;
use std::path::{Path, PathBuf};

#[derive(serde::Deserialize)]
struct Verdicts {
    duration: Vec<DurationCase>,
    manifest: Vec<ManifestCase>,
}

#[derive(serde::Deserialize)]
struct DurationCase {
    text: String,
    millis: Option<u64>,
    ttl: String,
    lease: String,
}

#[derive(serde::Deserialize)]
struct ManifestCase {
    name: String,
    scope: String,
    text: String,
    verdict: String,
    ttl_ms: Option<u64>,
    lease_ms: Option<u64>,
}

const VERDICTS: &str = include_str!("../../idempotent-macros/rules/tests/verdicts.toml");

struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("idem-verdicts-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        Scratch(dir)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("write the manifest");
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What the CLI says about the manifest at `path`: `Err(message)` or the manifest.
async fn cli_verdict(path: &Path) -> Result<Manifest, String> {
    let path = path.to_str().expect("a UTF-8 scratch path");
    run_from(["idempotent", "scopes", "--manifest", path])
        .await
        .map_err(|e| e.to_string())?;
    // The CLI accepted it: the manifest functions it used give the values.
    Manifest::load(path).map_err(|e| panic!("the CLI accepted what load refuses: {e}"))
}

fn assert_verdict(
    what: &str,
    verdict: &str,
    got: Result<Option<u64>, String>,
    millis: Option<u64>,
) {
    match (verdict.strip_prefix("error: "), got) {
        (None, Ok(value)) => {
            assert_eq!(
                verdict, "ok",
                "{what}: a verdict is \"ok\" or \"error: ...\""
            );
            if let Some(expected) = millis {
                assert_eq!(value, Some(expected), "{what}");
            }
        }
        (None, Err(e)) => panic!("{what}: expected ok, got: {e}"),
        (Some(_), Ok(_)) => panic!("{what}: expected {verdict:?}, got ok"),
        (Some(text), Err(e)) => assert!(e.contains(text), "{what}: expected {text:?} in: {e}"),
    }
}

#[tokio::test]
async fn durations_get_the_tables_verdict() {
    let verdicts: Verdicts = toml::from_str(VERDICTS).expect("verdicts.toml");
    let scratch = Scratch::new("durations");
    for (i, case) in verdicts.duration.iter().enumerate() {
        for (field, verdict) in [("ttl", &case.ttl), ("lease", &case.lease)] {
            let text = format!("[scopes.\"a.b\"]\n{field} = {:?}\n", case.text);
            let path = scratch.write(&format!("d{i}-{field}.toml"), &text);
            let got = cli_verdict(&path).await.map(|m| {
                let s = &m.scopes["a.b"];
                let d = if field == "ttl" { s.ttl } else { s.lease };
                d.map(|d| d.as_millis() as u64)
            });
            assert_verdict(
                &format!("manifest {field} = {:?}", case.text),
                verdict,
                got,
                case.millis,
            );
        }
    }
}

#[tokio::test]
async fn manifests_get_the_tables_verdict() {
    let verdicts: Verdicts = toml::from_str(VERDICTS).expect("verdicts.toml");
    let scratch = Scratch::new("manifests");
    for (i, case) in verdicts.manifest.iter().enumerate() {
        let path = scratch.write(&format!("m{i}.toml"), &case.text);
        let verdict = case
            .verdict
            .replace("MANIFEST", &path.display().to_string());
        let got = match cli_verdict(&path).await {
            Err(e) => Err(e),
            Ok(m) => m.check_scope(&case.scope).map_err(|e| e.to_string()),
        };
        match got {
            Ok(defaults) => {
                assert_verdict(&case.name, &verdict, Ok(None), None);
                let ms = |d: Option<std::time::Duration>| d.map(|d| d.as_millis() as u64);
                assert_eq!(ms(defaults.ttl), case.ttl_ms, "{}", case.name);
                assert_eq!(ms(defaults.lease), case.lease_ms, "{}", case.name);
            }
            Err(e) => assert_verdict(&case.name, &verdict, Err(e), None),
        }
    }
}
