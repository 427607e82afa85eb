use idempotent_runtime::{idempotent, Error};

#[idempotent(scope = "values.fingerprint", key = key, tenant = shared, fingerprint = "no")]
async fn fingerprint_not_bool(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "values.in_progress", key = key, tenant = shared, in_progress = queue)]
async fn in_progress_unknown(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "values.wait", key = key, tenant = shared, in_progress = wait)]
async fn wait_without_duration(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "values.errors", key = key, tenant = shared, errors = ignore)]
async fn errors_unknown(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "values.record_if", key = key, tenant = shared, errors = record_if("final"))]
async fn record_if_not_a_path(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "values.krate", key = key, tenant = shared, crate = "idempotent_runtime")]
async fn crate_not_a_path(key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "values.skip", key = key, tenant = shared, skip = note)]
async fn skip_not_a_list(key: &str, note: u8) -> Result<u8, Error> {
    Ok(1)
}

#[idempotent(scope = "values.bare", key, tenant = shared)]
async fn key_without_value(key: &str) -> Result<u8, Error> {
    Ok(1)
}

fn main() {}
